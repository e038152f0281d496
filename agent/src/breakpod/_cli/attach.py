"""The engineer's side of a remote pdb: a socket client with line editing.

Everything the server sends is printed; when it ends with a prompt, the
client reads a line locally (readline: editing and history) and sends it.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from breakpod import protocol
from breakpod._core import net
from breakpod._core.config import LISTENER_TOKEN_ENV, token_value
from breakpod._core.errors import AttachError
from breakpod._debug.listener import REFUSED, TOKEN_PROMPT

PROMPTS = ("(Pdb) ", ">>> ", "... ")
HISTORY = os.path.expanduser("~/.breakpod_history")
CONNECT_TIMEOUT = 5.0
# A remote pdb speaks first (its prompt, a token request or a refusal); so does a
# debugpy listener, at once, with a DAP message. Silence this long: not ours.
FIRST_WORDS_TIMEOUT = 10.0
DAP_HEADER = b"Content-Length:"
FOREIGN = (b"SSH-", b"HTTP/", b"220 ", b"+OK", b"-ERR")  # other servers' greetings
# The last event of a debugpy adapter's greeting. Its accept loop dies when a client
# hangs up before the greeting is written (debugpy 1.8), and the next client, the
# engineer's VS Code, would wait for ever: the probe hears it out, up to a second.
DAP_GREETING_END = b'"debugpySockets"'
DAP_GREETING_WAIT = 1.0


def attach(
    host: str,
    port: int,
    *,
    token: str | None = None,
    out: TextIO = sys.stdout,
    read_line: Callable[[str], str] = input,
    remote_root: str | None = None,
) -> None:
    """Run an interactive session until the remote side closes or EOF is typed.
    A debugpy listener gets its launch.json printed and an :class:`AttachError`;
    its ``remoteRoot`` is ``remote_root``, else the listener's working directory
    when it runs on this machine (:func:`listener_cwd`), else ``.``."""
    sock = connect(host, port)
    with sock:
        first = _first_words(sock, host, port)
        if first.startswith(DAP_HEADER):
            _hear_out(sock, first)
            root = remote_root or listener_cwd(host, port) or "."
            out.write(vscode_launch(host, port, root, "${workspaceFolder}") + "\n")
            raise AttachError(dap_listener_message(f"{host}:{port}"))
        with _history():
            _session(sock, first, token, out, read_line)


def dap_listener_message(where: str) -> str:
    """Why attach stops at a debugpy listener (exit 2, by address or by session)."""
    return (
        f"{where} is a debugpy (DAP) listener, not a remote pdb: open the "
        "launch.json above in VS Code (or any DAP client), or run the job with "
        "BREAKPOD_BACKEND=pdb to attach from a terminal"
    )


def listener_cwd(host: str, port: int) -> str | None:
    """The working directory of the debugpy adapter listening on loopback ``port`` of
    this machine (attach by address inside the job's container, or on its host): the
    job's own, which the adapter inherits. None when the listener is not a debugpy
    process visible here (a ``kubectl port-forward``'s port is kubectl's)."""
    try:
        if not net.is_loopback(host):
            return None
    except (OSError, UnicodeError, ValueError):  # not an address this machine resolves
        return None
    inode = _listening_inode(port)
    for proc in Path("/proc").iterdir() if inode else ():
        try:
            if f"socket:[{inode}]" not in {os.readlink(fd) for fd in (proc / "fd").iterdir()}:
                continue
            if b"debugpy" not in (proc / "cmdline").read_bytes():
                return None
            return os.readlink(proc / "cwd")
        except (OSError, ValueError):
            continue
    return None


def _listening_inode(port: int) -> str | None:
    """The socket inode of the TCP listener on ``port`` (Linux's /proc/net tables)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                return fields[9]
    return None


def _first_words(sock: socket.socket, host: str, port: int) -> bytes:
    """What the listener says first: enough bytes to tell DAP from pdb."""
    sock.settimeout(FIRST_WORDS_TIMEOUT)
    data = b""
    try:
        while len(data) < len(DAP_HEADER) and DAP_HEADER.startswith(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise AttachError(
            f"{host}:{port} accepted but said nothing in {FIRST_WORDS_TIMEOUT:g}s: it is not a "
            "breakpod listener (a parked process greets at once); check the address"
        ) from None
    except OSError as e:
        raise AttachError(f"the connection to {host}:{port} broke: {e.strerror or e}") from e
    if not data or data.startswith(FOREIGN) or not _text(data):
        said = f"said {data[:40]!r}" if data else "closed the connection without a word"
        raise AttachError(
            f"{host}:{port} {said}: it is not a debugger listener (a parked process "
            "greets with 'breakpod: ...'); check the address"
        )
    return data


def _text(data: bytes) -> bool:
    """What a pdb says: UTF-8 text (perhaps cut mid-character) without control codes."""
    text = data.decode("utf-8", errors="ignore")
    return bool(text) and all(c.isprintable() or c in "\r\n\t" for c in text)


def _hear_out(sock: socket.socket, data: bytes) -> None:
    """Read a DAP greeting to its end before hanging up (see DAP_GREETING_END)."""
    deadline = time.monotonic() + DAP_GREETING_WAIT
    while DAP_GREETING_END not in data and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        data += chunk


def connect(host: str, port: int) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except UnicodeError:  # the name lookup's IDNA encoding: an empty or too long label
        raise AttachError(f"{host!r} is not a host name: check the address") from None
    except OSError as e:
        raise AttachError(
            f"nothing accepts connections on {host}:{port} ({e.strerror or e}). "
            "Is the process parked? Check the 'waiting for a debugger' line in its log, "
            "and for a pod run kubectl port-forward first"
        ) from e


def _session(
    sock: socket.socket,
    first: bytes,
    token: str | None,
    out: TextIO,
    read_line: Callable[[str], str],
) -> None:
    sock.settimeout(None)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # ∈ μ σ split by recv
    pending = tail = ""
    data = first
    try:
        while True:
            if not data:
                _closed(pending, tail, out)
                return
            text = decoder.decode(data)
            tail = (tail + text)[-4096:]
            pending = _show(pending + text, out)
            if pending.endswith(TOKEN_PROMPT):
                sock.sendall((_token(token) + "\n").encode())
                pending = ""
            elif pending in PROMPTS:
                line = _read(pending, read_line, out)
                if line is None:
                    return
                sock.sendall((line + "\n").encode())
                pending = ""
            data = sock.recv(65536)
    except AttachError:
        raise
    except OSError as e:  # a reset right after a refusal is the refusal
        _refused(tail)
        raise AttachError(f"the connection to the debugger broke: {e.strerror or e}") from e


def _closed(pending: str, tail: str, out: TextIO) -> None:
    """The remote side hung up: a refusal (wrong token, busy) is an error (exit 1)."""
    _refused(tail)
    out.write(pending + "\nbreakpod: the remote side closed the session\n")


def _refused(tail: str) -> None:
    refusal = next((line for line in tail.splitlines() if line.startswith(REFUSED)), None)
    if refusal is not None:
        raise AttachError(f"the listener refused this client: {refusal[len(REFUSED) :]}")


def _show(text: str, out: TextIO) -> str:
    """Print what arrived, less a refusal (the error says it); keep back a prompt (or
    the start of one) to handle it."""
    if text.endswith(TOKEN_PROMPT):
        _write(text[: -len(TOKEN_PROMPT)], out)
        return TOKEN_PROMPT
    prompt = next((p for p in PROMPTS if text.endswith(p)), None)
    keep = len(prompt) if prompt else _partial_prompt_length(text)
    _write(text[: len(text) - keep], out)
    return text[len(text) - keep :]


def _write(text: str, out: TextIO) -> None:
    lines = text.splitlines(keepends=True)
    out.write("".join(line for line in lines if not line.startswith(REFUSED)))
    out.flush()


def _read(prompt: str, read_line: Callable[[str], str], out: TextIO) -> str | None:
    """One line typed by the engineer; None on EOF (Ctrl-D) = detach."""
    while True:
        try:
            line = read_line(prompt)
            if read_line is input and not sys.stdin.isatty():
                out.write(line + "\n")  # scripted input: keep the transcript readable
            return line
        except KeyboardInterrupt:
            out.write("\n")
        except EOFError:
            out.write("\nbreakpod: detached; the program continues\n")
            return None


def _partial_prompt_length(text: str) -> int:
    for n in range(max(map(len, PROMPTS)) - 1, 0, -1):
        if any(p.startswith(text[-n:]) for p in PROMPTS):
            return n
    return 0


def _token(token: str | None) -> str:
    """Stripped, as the listener strips its own (a token read from a file ends in \\n)."""
    token = (token or token_value(LISTENER_TOKEN_ENV) or "").strip()
    if token:
        return token
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("breakpod token: ").strip()
    raise AttachError(
        f"the listener requires a token: set {LISTENER_TOKEN_ENV} or pass --listener-token"
    )


@contextlib.contextmanager
def _history() -> Iterator[None]:
    try:
        import readline
    except ImportError:
        yield
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(HISTORY)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            readline.set_history_length(1000)
            readline.write_history_file(HISTORY)


def vscode_launch(host: str, port: int, remote_root: str, local_root: str) -> str:
    """A VS Code ``launch.json`` that attaches to a debugpy listener (the protocol's)."""
    config = protocol.vscode_launch(
        f"attach {host}:{port}", host, port, local_root=local_root, remote_root=remote_root
    )
    return json.dumps(config, indent=2)
