"""The remote pdb listener: one TCP socket, one debugger client at a time.

An acceptor thread owns the listening socket. The first client that passes
the token check (required only on non-loopback binds) takes the single slot
and is handed to whoever waits in :meth:`Listener.wait_for_client`; any other
client gets one line of explanation and is closed. The protocol is plain text,
so ``nc``, ``socat`` and ``telnet`` work as well as ``breakpod attach``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time

from breakpod import net

log = logging.getLogger(__name__)

TOKEN_PROMPT = "breakpod: token required: send BREAKPOD_TOKEN as the first line\n"
HANDSHAKE_SECONDS = 10.0  # in all, however slowly the client sends
MAX_HANDSHAKES = 4


class ClientIO:
    """File-like text stream over the current client socket, for pdb.

    Socket errors never propagate: a dead client reads as EOF, which the
    debugger treats as a detach. ``attach`` swaps in a new client without
    pdb noticing, so ``BREAKPOD_ON_DETACH=wait`` can hand the session over.
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._buffer = b""

    def attach(self, sock: socket.socket) -> None:
        self.close()
        sock.settimeout(None)
        self._sock = sock

    def write(self, text: str) -> int:
        if self._sock is not None:
            try:
                self._sock.sendall(text.encode())
            except OSError:
                self.close()
        return len(text)

    def flush(self) -> None:
        """Writes are unbuffered."""

    def readline(self, size: int = -1) -> str:
        while self._sock is not None and b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            self._buffer += chunk
        line, sep, self._buffer = self._buffer.partition(b"\n")
        if not sep and self._sock is None:
            return ""  # EOF: anything unterminated is dropped with the client
        return line.rstrip(b"\r").decode(errors="replace") + "\n"

    def close(self) -> None:
        sock, self._sock, self._buffer = self._sock, None, b""
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class Listener:
    """A bound socket plus the acceptor thread that guards its single slot."""

    def __init__(
        self, host: str, port: int, *, token: str | None = None, require_token: bool = False
    ) -> None:
        self._sock = net.bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._token = token if require_token or not net.is_loopback(host) else None
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._handoff: queue.Queue[socket.socket | None] = queue.Queue(maxsize=1)
        self._owner: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._waiting = False
        self.interrupted = False  # the last wait ended by interrupt()
        threading.Thread(target=self._accept_loop, name="breakpod-listener", daemon=True).start()

    @property
    def address(self) -> str:
        return net.format_address(self.host, self.port)

    def wait_for_client(self, timeout: float | None) -> socket.socket | None:
        """The next live client; ``None`` after ``timeout`` seconds or :meth:`interrupt`."""
        self._waiting, self.interrupted = True, False
        _drop_stale_interrupt(self._handoff)
        try:
            while True:
                try:
                    sock = self._handoff.get(timeout=timeout)
                except queue.Empty:
                    return None
                if sock is None:  # interrupt()
                    self.interrupted = True
                    return None
                if _alive(sock):
                    return sock
                self.release(sock)
        finally:
            self._waiting = False

    def interrupt(self) -> bool:
        """End a :meth:`wait_for_client` now (a broker ``resume``); False when none waits."""
        if not self._waiting:
            return False
        try:
            self._handoff.put(None, timeout=0.1)
        except queue.Full:
            return False
        return True

    def disconnect(self) -> bool:
        """Hang up on the attached client (a broker ``detach``); False when there is none."""
        with self._lock:
            owner = self._owner
        if owner is None:
            return False
        with contextlib.suppress(OSError):
            owner.shutdown(socket.SHUT_RDWR)
        return True

    def release(self, sock: socket.socket) -> None:
        """Free the slot a finished client held."""
        with self._lock:
            if self._owner is sock:
                self._owner = None

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._token is None:
                self._admit(conn)
            elif self._handshakes.acquire(blocking=False):
                # A slow or silent client must not hold up everyone else's accept.
                threading.Thread(
                    target=self._authenticate,
                    args=(conn, self._token),
                    name="breakpod-handshake",
                    daemon=True,
                ).start()
            else:
                _refuse(conn, "too many clients are authenticating; try again later")

    def _authenticate(self, conn: socket.socket, token: str) -> None:
        try:
            if _check_token(conn, token):
                self._admit(conn)
            else:
                _refuse(conn, "wrong or missing token; set BREAKPOD_TOKEN to the job's token")
        finally:
            self._handshakes.release()

    def _admit(self, conn: socket.socket) -> None:
        """Give ``conn`` the slot, or refuse it when a live client holds it."""
        try:
            with self._lock:
                owner = self._owner
                if owner is not None and _alive(owner):
                    _refuse(conn, "another debugger client is already attached; try again later")
                    return
                self._owner = conn
            _drain(self._handoff)
            self._handoff.put(conn)
        except OSError:
            conn.close()


def _check_token(conn: socket.socket, token: str) -> bool:
    """Read the first line within HANDSHAKE_SECONDS in all, and compare it in constant time."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    line = b""
    try:
        conn.sendall(TOKEN_PROMPT.encode())
        while b"\n" not in line and len(line) < 4096:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = conn.recv(4096)
            if not chunk:
                break
            line += chunk
    except OSError:  # includes the timeout
        return False
    finally:
        conn.settimeout(None)
    import hmac  # only token-protected listeners need it

    sent = line.partition(b"\n")[0].strip()
    return hmac.compare_digest(sent, token.encode())


def _refuse(conn: socket.socket, why: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"breakpod: refused: {why} (pid {os.getpid()})\n".encode())
    conn.close()


def _alive(sock: socket.socket) -> bool:
    """False once the peer has closed; never blocks and never consumes data."""
    if sock.fileno() < 0:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _drop_stale_interrupt(q: queue.Queue[socket.socket | None]) -> None:
    """An interrupt() that raced with the end of the previous wait must not end this one."""
    with q.mutex:
        if q.queue and q.queue[0] is None:
            q.queue.popleft()
            q.not_full.notify()


def _drain(q: queue.Queue[socket.socket | None]) -> None:
    """Drop a queued client whose slot was taken over (it already disconnected)."""
    while True:
        try:
            sock = q.get_nowait()
        except queue.Empty:
            return
        if sock is not None:
            sock.close()
