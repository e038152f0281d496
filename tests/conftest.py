"""Shared fixtures: real child processes and raw socket clients."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PARK_LINE = re.compile(r"waiting .* on (\S+):(\d+)")


class Child:
    """A Python child process running a script, its stderr captured to a file."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float = 15.0) -> re.Match[str]:
        """Wait for ``pattern`` on the child's stderr; fail with what it printed."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = regex.search(self.stderr)
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(
            f"{regex.pattern!r} not seen; rc={self.proc.poll()}; stderr:\n{self.stderr}"
        )

    def park_port(self, timeout: float = 15.0) -> int:
        return int(self.wait_for(PARK_LINE, timeout).group(2))

    def wait(self, timeout: float = 20.0) -> int:
        """The exit status; on timeout, fail with what the child printed on stderr."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout}s; stderr:\n{self.stderr}\n"
                f"processes:\n{signal_states(self.proc.pid)}"
            ) from None

    def stdout(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.read().decode(errors="replace")


def _terminal_signals() -> None:
    """In the child, before exec: SIGINT, SIGHUP and SIGQUIT as a terminal's job gets them.
    A pytest-xdist worker was once seen with all three ignored mid-run (inherited by its
    children across exec: a Ctrl-C sent to one did nothing)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def signal_states(pid: int) -> str:
    """Each process of the tree from ``pid``: its command line and the kernel's view of
    its signals (pending, blocked, ignored, caught) and state, to tell why one that was
    sent a signal did not end."""
    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return "(gone)"
    lines = []
    for proc in tree:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            kept = [line for line in status.splitlines() if line.startswith(STATUS_FIELDS)]
            lines.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}: {'; '.join(kept)}")
        except (OSError, psutil.Error) as e:
            lines.append(f"{proc.pid}: {e}")
    return "\n".join(lines)


STATUS_FIELDS = ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[object]:
    """spawn(source, env=..., stdin="devnull"|"closed") -> Child; killed at teardown."""
    children: list[Child] = []

    def _spawn(
        source: str,
        *,
        env: dict[str, str] | None = None,
        stdin: str = "devnull",
        args: list[str] | None = None,
        breakpod: bool = True,
    ) -> Child:
        script = tmp_path / f"child{len(children)}.py"
        script.write_text(textwrap.dedent(source))
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
        full_env.update({"PYTHONUNBUFFERED": "1", "BREAKPOD_PORT": "0"})
        if breakpod:
            full_env["PYTHONBREAKPOINT"] = "breakpod.set_trace"
        else:
            full_env.pop("PYTHONBREAKPOINT", None)
        full_env.update(env or {})
        stderr_path = tmp_path / f"child{len(children)}.err"
        cmd = [sys.executable, str(script), *(args or [])]
        if stdin == "closed":  # fd 0 closed before Python starts: sys.stdin is None
            cmd = ["/bin/sh", "-c", 'exec "$@" <&-', "sh", *cmd]
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL if stdin == "devnull" else None,
                stdout=subprocess.PIPE,
                stderr=err,
                env=full_env,
                preexec_fn=_terminal_signals,
            )
        child = Child(proc, stderr_path)
        children.append(child)
        return child

    yield _spawn
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(timeout=10)


class PdbClient:
    """A raw socket client: what nc would do, with a prompt-aware reader."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buffer = ""

    def read_until(self, marker: str = "(Pdb) ") -> str:
        while marker not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError(f"closed before {marker!r}; got {self.buffer!r}")
            self.buffer += data.decode(errors="replace")
        text, _, self.buffer = self.buffer.partition(marker)
        return text

    def read_all(self) -> str:
        chunks = [self.buffer]
        self.buffer = ""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data.decode(errors="replace"))
        return "".join(chunks)

    def send(self, line: str) -> None:
        self.sock.sendall((line + "\n").encode())

    def command(self, line: str) -> str:
        """Send a pdb command and return its output up to the next prompt."""
        self.send(line)
        return self.read_until()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def pdb_client() -> Iterator[object]:
    clients: list[PdbClient] = []

    def _connect(port: int, host: str = "127.0.0.1") -> PdbClient:
        client = PdbClient(port, host)
        clients.append(client)
        return client

    yield _connect
    for client in clients:
        client.close()
