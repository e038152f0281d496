"""Real torchrun jobs (gloo, CPU) for the multi-rank tests; stdin closed, stderr to a file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

JOB = Path(__file__).with_name("stall_job.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


class Job:
    def __init__(
        self, tmp_path: Path, nproc: int, port: int, script: Path = JOB, **env: str
    ) -> None:
        self.stderr_path = tmp_path / f"torchrun-{port}.err"
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("BREAKPOD_") and k != "ENABLE_REMOTE_DEBUG"
        }
        clean.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **env)
        cmd = [str(TORCHRUN), f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1"]
        cmd += [f"--master-port={port}", f"--rdzv-id=job-{port}", str(script)]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=clean,
                start_new_session=True,  # torchrun and its ranks: one group to kill
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> tuple[re.Match[str], float]:
        """The first match on the job's stderr, and when it was seen (monotonic)."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = regex.search(self.stderr)
            if match:
                return match, time.monotonic()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not seen; rc={self.proc.poll()}; stderr:\n{self.stderr}")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGTERM to torchrun (it stops its ranks), then SIGKILL to whatever is left:
        its process group, and its ranks, which torch's elastic agent starts in sessions
        of their own (a rank parked past SIGTERM outlived a torchrun killed first)."""
        ranks = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        self.proc.wait(timeout=10)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def free_ports(count: int, start: int = 47300) -> int:
    """A base port with ``count`` free ports from it (BREAKPOD_PORT + LOCAL_RANK).

    Each pytest-xdist worker searches its own 200 ports, so two workers never find the
    same range free at once and both bind it."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    start += 200 * worker
    for base in range(start, start + 200, 10):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free port range")


def pdb_session(port: int, *commands: str, timeout: float = 30.0) -> str:
    """Attach to a parked rank's pdb, send each command at a prompt, return the dialogue."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        seen = b""
        for command in commands:
            while not seen.endswith(b"(Pdb) "):
                chunk = sock.recv(4096)
                assert chunk, seen.decode(errors="replace")
                seen += chunk
            sock.sendall(command.encode() + b"\n")
            seen += command.encode() + b"\n"
        while chunk := sock.recv(4096):
            seen += chunk
    return seen.decode(errors="replace")
