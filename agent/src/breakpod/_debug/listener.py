"""The remote pdb listener: one TCP socket, one debugger client at a time.

One thread owns the listening socket and every pending token handshake (a
selector, no thread per client). The first client that passes the token check
(required on non-loopback binds, or with BREAKPOD_REQUIRE_TOKEN) takes the
single slot and is handed to whoever waits in :meth:`Listener.wait_for_client`;
any other client gets one line of explanation and is closed. The protocol is
plain text, so ``nc``, ``socat`` and ``telnet`` work as well as ``breakpod attach``.

Nobody reaching the port can guess the token fast or hurt the job: every token
line, right or wrong, is compared only when the throttle allows
(:mod:`breakpod._core.throttle`: one comparison per opening, oldest line first),
so a thousand connections guessing at once guess no faster than one; handshakes
are evicted when the slots are full (silent ones first), token lines are capped at 1 KiB and pdb
lines at 1 MiB (both read in linear time), and an attached client that sends
nothing for BREAKPOD_ATTACH_IDLE is dropped so the hold time applies again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import socket
import threading
import time

from breakpod._core import net, threads
from breakpod._core.config import LISTENER_TOKEN_ENV
from breakpod._core.throttle import GuessThrottle

log = logging.getLogger(__name__)

REFUSED = "breakpod: refused: "  # the client tells a refusal from a session's end by it
TOKEN_PROMPT = f"breakpod: token required: send {LISTENER_TOKEN_ENV} as the first line\n"
NOT_PARKED = "breakpod: pid {pid} is not parked yet; the session starts at its next park\n"
HANDSHAKE_SECONDS = 10.0  # to send the token line, however slowly
MAX_HANDSHAKES = 16  # silent handshakes at once (no token line yet); a new one ends the oldest
MAX_QUEUED = 256  # token lines waiting their turn (fewer where the process may open few files)
FILES_SHARE = 8  # ... at most this fraction of the files it may open: the job needs its own
ACCEPT_PAUSE = 0.1  # after accept() failed (out of files): the backlog waits this long
MAX_TOKEN_LINE = 1024
MAX_ACCEPTS = 64  # connections taken from the backlog per wake-up
MAX_LINE = 1 << 20  # a longer pdb line is dropped (with a note), never buffered
RECV_BYTES = 65536


class ClientIO:
    """File-like text stream over the current client socket, for pdb.

    Socket errors never propagate: a dead client reads as EOF, which the
    debugger treats as a detach. ``attach`` swaps in a new client without
    pdb noticing, so ``BREAKPOD_ON_DETACH=wait`` can hand the session over.
    A client that sends nothing (or reads nothing) for ``idle_seconds`` also
    reads as EOF, with ``idled`` set.
    """

    def __init__(self, idle_seconds: float = math.inf) -> None:
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._scanned = 0  # no newline before this offset: each byte is searched once
        self._skipping = False  # inside an over-long line, dropping it
        self._prompt = ""  # the last text written without a newline: pdb's prompt
        self.idle_seconds = idle_seconds
        self.idled = False

    def attach(self, sock: socket.socket) -> None:
        self.close()
        sock.settimeout(None if math.isinf(self.idle_seconds) else self.idle_seconds)
        self._sock, self.idled = sock, False

    def write(self, text: str) -> int:
        self._prompt = "" if text.endswith("\n") else text
        self._send(text)
        return len(text)

    def _send(self, text: str) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(text.encode())
            except TimeoutError:  # the client reads nothing: as idle as sending nothing
                self._drop_idle()
            except OSError:
                self.close()

    def flush(self) -> None:
        """Writes are unbuffered."""

    def readline(self, size: int = -1) -> str:
        while self._sock is not None:
            line = self._next_line()
            if line is not None:
                return line.rstrip(b"\r").decode(errors="replace") + "\n"
            chunk = self._recv()
            if not chunk:
                self.close()
                break
            self._buffer += chunk
        return ""  # EOF: anything unterminated is dropped with the client

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._buffer, self._scanned, self._skipping = bytearray(), 0, False
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _next_line(self) -> bytes | None:
        """A complete line from the buffer, or None; drops a line past MAX_LINE."""
        end = self._buffer.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._buffer)
            if self._scanned > MAX_LINE:
                self._buffer, self._scanned, self._skipping = bytearray(), 0, True
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        self._scanned = 0
        if self._skipping:  # the tail of the over-long line
            self._skipping = False
            # the prompt again: pdb still waits for a line, and the client for its prompt
            self._send(f"*** breakpod: a line longer than {MAX_LINE} bytes was ignored\n")
            self._send(self._prompt)
            return self._next_line()
        return line

    def _recv(self) -> bytes:
        assert self._sock is not None
        try:
            return self._sock.recv(RECV_BYTES)
        except TimeoutError:
            self._drop_idle()
        except OSError:
            pass
        return b""

    def _drop_idle(self) -> None:
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(1.0)
                sock.sendall(b"breakpod: idle too long; disconnecting\n")
        self.close()
        self.idled = True


class _Handshake:
    """A client that still has to send the token line (a plain class: no import cost)."""

    __slots__ = ("conn", "data", "deadline", "line", "lined", "peer")

    def __init__(self, conn: socket.socket, peer: str, deadline: float) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.data = bytearray()
        self.line: bytes | None = None  # the complete token line, once it arrived
        self.lined = 0.0  # when it arrived: the oldest line is compared first


class Listener:
    """A bound socket plus the thread that guards its single slot."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        require_token: bool = False,
        attach_idle: float = math.inf,
    ) -> None:
        self._sock = net.bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.attach_idle = attach_idle
        token = token.strip() if token else None  # as the client strips what it sends
        self._token = (
            token.encode() if token and (require_token or not net.is_loopback(host)) else None
        )
        self._throttle = GuessThrottle()
        self._max_queued = _queue_limit()
        self._paused_until = 0.0  # accept() failed (out of files): the backlog waits
        self._pending: dict[socket.socket, _Handshake] = {}
        self._selector = selectors.DefaultSelector()
        self._handoff = _Handoff()
        self._owner: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._waiting = 0  # waits under way (one nests in another in a signal handler)
        self.interrupted = ""  # why interrupt() ended the last wait ("": it did not)
        self._interrupt_why = ""
        threads.start_daemon(self._serve, "breakpod-listener")

    @property
    def requires_token(self) -> bool:
        """Whether a client must send the token first (the park hint says so)."""
        return self._token is not None

    @property
    def address(self) -> str:
        return net.format_address(self.host, self.port)

    def wait_for_client(self, timeout: float | None) -> socket.socket | None:
        """The next live client; ``None`` after ``timeout`` seconds or :meth:`interrupt`."""
        self._waiting += 1
        self.interrupted = ""
        self._handoff.drop_interrupt()
        try:
            while True:
                handed, sock = self._handoff.take(timeout)
                if not handed:
                    return None
                if sock is None:  # interrupt()
                    self.interrupted = self._interrupt_why
                    return None
                if alive(sock):
                    return sock
                self.release(sock)
        finally:
            self._waiting -= 1

    def interrupt(self, why: str = "resume command") -> bool:
        """End a :meth:`wait_for_client` now (a broker ``resume``, or a job-wide break that
        ended or moved on), saying ``why``; False when none waits."""
        if not self._waiting:
            return False
        self._interrupt_why = why
        return self._handoff.offer_interrupt()

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

    # -- the listener thread ------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._sock.setblocking(False)
            listening = False
            while not self._closed:
                if self._room() != listening:
                    listening = not listening
                    if listening:
                        self._selector.register(self._sock, selectors.EVENT_READ)
                    else:
                        self._selector.unregister(self._sock)
                for key, _ in self._selector.select(self._next_wakeup()):
                    if key.fileobj is self._sock:
                        self._accept_all()
                    elif (h := self._pending.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._read_token(h)  # (one evicted earlier in this batch is gone)
                self._expire()
                self._judge()
        except (OSError, ValueError):  # closed (close(), or a fork's child)
            pass
        finally:
            for pending in list(self._pending.values()):
                self._end_handshake(pending)

    def _next_wakeup(self) -> float:
        """Until the next deadline or the next token that may be judged; at most 1 s."""
        now = time.monotonic()
        wakeups = [1.0, *([self._paused_until - now] if self._paused_until > now else [])]
        for h in self._pending.values():
            wakeups.append(
                self._throttle.wait(h.peer, now) if h.line is not None else h.deadline - now
            )
        return max(0.0, min(wakeups))

    def _room(self) -> bool:
        """Take a connection from the backlog? Not while the queue of token lines is
        full: the next connections then wait in the kernel's backlog, in the order they
        came, each taking a place as one frees (none is pushed out unheard, so the real
        client's line is compared after those before it, however many flood)."""
        if time.monotonic() < self._paused_until:
            return False
        return sum(h.line is not None for h in self._pending.values()) < self._max_queued

    def _accept_all(self) -> None:
        """Take what the backlog holds while there is room (up to a bound, so tokens
        are still judged on time)."""
        for _ in range(MAX_ACCEPTS):
            if not self._room() or not self._accept():
                return

    def _accept(self) -> bool:
        try:
            conn, addr = self._sock.accept()
        except BlockingIOError:
            return False
        except OSError:  # out of files: the job's own come first; try again shortly
            self._paused_until = time.monotonic() + ACCEPT_PAUSE
            return False
        if self._token is None:
            conn.setblocking(True)
            self._admit(conn)
            return True
        handshake = _Handshake(conn, str(addr[0]), time.monotonic() + HANDSHAKE_SECONDS)
        try:
            conn.setblocking(False)
            conn.send(TOKEN_PROMPT.encode())
            self._selector.register(conn, selectors.EVENT_READ)
        except OSError:
            conn.close()
            return True
        self._pending[conn] = handshake
        self._read_token(handshake)  # sent as it connected: then :meth:`_room` knows it
        self._make_room()
        return True

    def _make_room(self) -> None:
        """Close the oldest silent handshake past MAX_HANDSHAKES: a client sends its
        token line as it connects (``breakpod attach`` does), so handshakes held open,
        silent or a byte at a time, never keep it out. (A line past the queue's limit,
        possible only in a race, is the newest: its client learns nothing.)"""
        silent = [h for h in self._pending.values() if h.line is None]
        if len(silent) > MAX_HANDSHAKES:
            oldest = min(silent, key=lambda h: h.deadline)
            self._end_handshake(oldest, "too many clients are authenticating; try again later")
        lines = [h for h in self._pending.values() if h.line is not None]
        if len(lines) > self._max_queued:
            newest = max(lines, key=lambda h: h.lined)
            self._end_handshake(newest, "too many clients are authenticating; try again later")

    def _read_token(self, h: _Handshake) -> None:
        try:
            chunk = h.conn.recv(MAX_TOKEN_LINE + 1)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._end_handshake(h)
            return
        h.data += chunk
        line, newline, _ = h.data.partition(b"\n")
        if newline:
            h.line, h.lined = bytes(line), time.monotonic()
            self._selector.unregister(h.conn)  # judged when the throttle allows
        elif len(h.data) > MAX_TOKEN_LINE:
            self._end_handshake(h, "token line too long")

    def _expire(self) -> None:
        now = time.monotonic()
        for h in [h for h in self._pending.values() if h.line is None and h.deadline <= now]:
            self._end_handshake(h, f"no token within {HANDSHAKE_SECONDS:g}s")

    def _judge(self) -> None:
        """Compare one token line, the oldest whose wait is over: a right one is
        admitted, a wrong one refused and counted. Only a comparison tells a client
        anything, right or wrong, so one per throttle opening bounds the guesses per
        second however many connections guess at once (each used to be compared as
        it came: a right token got in at once, so the delay only slowed refusals)."""
        assert self._token is not None or not self._pending
        now = time.monotonic()
        due = [
            h
            for h in self._pending.values()
            if h.line is not None and self._throttle.wait(h.peer, now) <= 0
        ]
        for h in sorted(due, key=lambda h: h.lined):
            if alive(h.conn):
                self._compare(h)
                return
            self._end_handshake(h)  # gone before its turn: no comparison spent on it

    def _compare(self, h: _Handshake) -> None:
        import hmac  # only a listener with a token needs it

        assert h.line is not None and self._token is not None
        now = time.monotonic()
        del self._pending[h.conn]
        if hmac.compare_digest(h.line.strip(), self._token):
            self._throttle.succeeded(h.peer)
            h.conn.setblocking(True)
            self._admit(h.conn)
        else:
            self._throttle.failed(h.peer, now)
            _refuse(h.conn, f"wrong or missing token; set {LISTENER_TOKEN_ENV} to the job's")

    def _end_handshake(self, h: _Handshake, why: str | None = None) -> None:
        self._pending.pop(h.conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(h.conn)
        if why is None:
            h.conn.close()
        else:
            _refuse(h.conn, why)

    def _admit(self, conn: socket.socket) -> None:
        """Give ``conn`` the slot, or refuse it when a live client holds it."""
        try:
            with self._lock:
                owner = self._owner
                if owner is not None and alive(owner):
                    _refuse(conn, "another debugger client is already attached; try again later")
                    return
                self._owner = conn
            self._handoff.offer_client(conn)
            if not self._waiting:  # said at once: a listener that says nothing looks wrong
                conn.send(NOT_PARKED.format(pid=os.getpid()).encode(), socket.MSG_DONTWAIT)
        except OSError:
            conn.close()


def _queue_limit() -> int:
    """MAX_QUEUED, or fewer: each line waiting is an open file of the job's."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_QUEUED
    return max(MAX_HANDSHAKES, min(MAX_QUEUED, soft // FILES_SHARE))


def _refuse(conn: socket.socket, why: str) -> None:
    """One line, never blocking (a client that reads nothing loses it), then close."""
    with contextlib.suppress(OSError):
        conn.send(f"{REFUSED}{why} (pid {os.getpid()})\n".encode(), socket.MSG_DONTWAIT)
    conn.close()


def alive(sock: socket.socket) -> bool:
    """False once the peer has closed; never blocks and never consumes data."""
    if sock.fileno() < 0:
        return False
    try:
        poller = select.poll()  # not select(): a job may hold more than 1024 files
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


class _Handoff:
    """One slot between the acceptor thread and the waiting thread: a client, or
    ``None`` for an interrupt. A condition guards it; nobody reads another's lock."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._slot: list[socket.socket | None] = []  # at most one item

    def offer_client(self, sock: socket.socket) -> None:
        """The newest client takes the slot; one queued before it already left (closed)."""
        with self._ready:
            for old in self._slot:
                if old is not None:
                    old.close()
            self._slot[:] = [sock]
            # all: a park nested in a signal handler waits in the same thread as the
            # park it interrupted, which cannot run; the running one takes the slot
            self._ready.notify_all()

    def offer_interrupt(self) -> bool:
        """False when the slot is taken (a client is being handed over)."""
        with self._ready:
            if self._slot:
                return False
            self._slot.append(None)
            self._ready.notify_all()
            return True

    def drop_interrupt(self) -> None:
        """An interrupt that raced with the end of the previous wait must not end this one."""
        with self._ready:
            if self._slot == [None]:
                self._slot.clear()

    def take(self, timeout: float | None) -> tuple[bool, socket.socket | None]:
        """(True, item) once the slot holds one; (False, None) after ``timeout`` seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: bool(self._slot), timeout):
                return False, None
            return True, self._slot.pop()
