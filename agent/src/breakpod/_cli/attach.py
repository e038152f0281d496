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
from collections.abc import Callable, Iterator
from typing import TextIO

from breakpod import protocol
from breakpod._core.config import ENV
from breakpod._core.errors import AttachError
from breakpod._debug.listener import REFUSED, TOKEN_PROMPT

PROMPTS = ("(Pdb) ", ">>> ", "... ")
HISTORY = os.path.expanduser("~/.breakpod_history")
CONNECT_TIMEOUT = 5.0


def attach(
    host: str,
    port: int,
    *,
    token: str | None = None,
    out: TextIO = sys.stdout,
    read_line: Callable[[str], str] = input,
) -> None:
    """Run an interactive session until the remote side closes or EOF is typed."""
    sock = connect(host, port)
    with sock, _history():
        _session(sock, token, out, read_line)


def connect(host: str, port: int) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except OSError as e:
        raise AttachError(
            f"nothing accepts connections on {host}:{port} ({e.strerror or e}). "
            "Is the process parked? Check the 'waiting for a debugger' line in its log, "
            "and for a pod run kubectl port-forward first"
        ) from e


def _session(
    sock: socket.socket, token: str | None, out: TextIO, read_line: Callable[[str], str]
) -> None:
    sock.settimeout(None)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # ∈ μ σ split by recv
    pending = tail = ""
    try:
        while True:
            data = sock.recv(65536)
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
    except OSError as e:
        raise AttachError(f"the connection to the debugger broke: {e.strerror or e}") from e


def _closed(pending: str, tail: str, out: TextIO) -> None:
    """The remote side hung up: a refusal (wrong token, busy) is an error (exit 1)."""
    refusal = next((line for line in tail.splitlines() if line.startswith(REFUSED)), None)
    if refusal is not None:
        raise AttachError(f"the listener refused this client: {refusal[len(REFUSED) :]}")
    out.write(pending + "\nbreakpod: the remote side closed the session\n")


def _show(text: str, out: TextIO) -> str:
    """Print what arrived; keep back a prompt (or the start of one) to handle it."""
    if text.endswith(TOKEN_PROMPT):
        out.write(text[: -len(TOKEN_PROMPT)])
        return TOKEN_PROMPT
    prompt = next((p for p in PROMPTS if text.endswith(p)), None)
    keep = len(prompt) if prompt else _partial_prompt_length(text)
    out.write(text[: len(text) - keep])
    out.flush()
    return text[len(text) - keep :]


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
    token = (token or os.environ.get(ENV["token"]) or "").strip()
    if token:
        return token
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("breakpod token: ").strip()
    raise AttachError("the listener requires a token: set BREAKPOD_TOKEN or pass --token")


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
