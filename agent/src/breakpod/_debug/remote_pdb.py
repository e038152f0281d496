"""pdb over a socket that never kills the program it debugs.

Differences from plain pdb, all in the direction of keeping a training job
alive: a client that disconnects or sends EOF ends the session as if
``continue`` was typed (or, with ``on_detach="wait"``, the next client takes
over); a client silent for BREAKPOD_ATTACH_IDLE (gone, or half-open) is
dropped and the hold time applies again, so the job never stays parked for
nobody; ``q`` detaches and continues unless ``quit_mode="exit"``;
``interact`` talks to the client instead of the process's stdin.
"""

from __future__ import annotations

import code
import os
import socket
import sys
import threading
import time
from types import FrameType, TracebackType

from breakpod import protocol
from breakpod._core import events, holding
from breakpod._core.announce import announce
from breakpod._core.config import format_seconds
from breakpod._debug.listener import ClientIO, Listener, alive
from breakpod._debug.pdb_commands import CommandsMixin
from breakpod._debug.registry import load_commands

# Stepping never stops inside breakpod or torch (like "just my code"): `s` on
# model(x) lands in the user's forward(), and a park started from a torch hook
# (an optimizer step hook) stops at the training loop's next line. Breakpoints
# set explicitly in those files still stop.
SKIP = ["breakpod", "breakpod.*", "torch", "torch.*"]


class RemoteSession:
    """One park: a listener, the client it handed over, and the detach policy."""

    def __init__(
        self,
        listener: Listener,
        *,
        reason: str,
        hold_seconds: float,
        on_detach: str = "continue",
    ) -> None:
        self.listener = listener
        self.reason = reason
        self.hold_seconds = hold_seconds
        self.on_detach = on_detach
        self.io = ClientIO(idle_seconds=listener.attach_idle)
        self._client: socket.socket | None = None
        self._holding = False

    def wait(self) -> bool:
        """Wait up to the hold time for a client; True when one attached."""
        self._hold(True)  # a parked or attached process is not a stalled one
        timeout = None if self.hold_seconds == float("inf") else self.hold_seconds
        try:
            sock = self.listener.wait_for_client(timeout)
        except BaseException:  # a signal handler's exception: the process runs on, unheld
            self._hold(False)
            raise
        if sock is None:
            self._hold(False)
            return False
        self._client = sock
        self.io.attach(sock)
        self.io.write(f"breakpod: attached to pid {os.getpid()}: {self.reason}\n")
        events.emit(
            protocol.ATTACHED,
            address=self.listener.address,
            reason=self.reason,
            **{protocol.CLIENT_FIELD: _peer(sock)},
        )
        return True

    @property
    def client(self) -> socket.socket | None:
        return self._client

    def end(self, why: str) -> None:
        self._hold(False)
        if self._client is None:
            return
        self.io.write(f"breakpod: {why}\n")
        self.io.close()
        self.listener.release(self._client)
        self._client = None
        until = hold_until(self.hold_seconds)  # a detached process waits again, as long
        events.emit(
            protocol.DETACHED,
            address=self.listener.address,
            why=why,
            **({protocol.HOLD_UNTIL_FIELD: until} if until is not None else {}),
        )

    def _hold(self, held: bool) -> None:
        if held != self._holding:
            self._holding = held
            (holding.hold if held else holding.release)()


class RemotePdb(CommandsMixin):
    """pdb bound to a :class:`RemoteSession` instead of stdin/stdout."""

    def __init__(
        self,
        session: RemoteSession,
        *,
        quit_mode: str = "detach",  # not protocol: a quit mode
    ) -> None:
        super().__init__(stdin=session.io, stdout=session.io, skip=SKIP, nosigint=True)  # type: ignore[arg-type]
        self.session = session
        self.quit_mode = quit_mode
        self.prompt = "(Pdb) "
        load_commands()

    def do_continue(self, arg: str) -> bool:
        stop = bool(super().do_continue(arg))
        if not self.breaks:
            _continued.pop(threading.get_ident(), None)
            self.session.end("continuing; the debugger detached")
            events.emit(protocol.RESUMED, address=self.session.listener.address)
        else:  # the client stays, for the breakpoints and the thread's next park
            _continued[threading.get_ident()] = self
        return stop

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool:
        if self.quit_mode == "exit":
            self.session.end("quitting: the program will stop (BREAKPOD_QUIT=exit)")
            return bool(super().do_quit(arg))
        self.message(
            "breakpod: detaching; the program continues (BREAKPOD_QUIT=exit makes q stop it)"
        )
        self.clear_all_breaks()
        return self.do_continue(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:
        idled = self.session.io.idled
        self.session.end(self._idle_notice() if idled else "client disconnected")
        if (idled or self.session.on_detach == "wait") and self.session.wait():
            self.print_stack_entry(self.stack[self.curindex])
            return False
        return self.do_continue(arg)

    def _idle_notice(self) -> str:
        """Said when an idle client is dropped; the park then waits for another one."""
        idle = format_seconds(self.session.io.idle_seconds)
        hold = format_seconds(self.session.hold_seconds)
        notice = f"the debugger client sent nothing for {idle} and was dropped"
        announce(f"{notice}; waiting up to {hold} for a debugger again")
        return notice

    def do_interact(self, arg: str) -> None:
        """interact: start an interactive interpreter over this connection."""
        frame = self.curframe
        assert frame is not None
        console = ClientConsole({**frame.f_globals, **self.curframe_locals}, self.session.io)
        saved, sys.stdout = sys.stdout, self.session.io
        try:
            console.interact("*interactive* (Ctrl-D or exit() to return to pdb)", "")
        except SystemExit:
            pass
        finally:
            sys.stdout = saved


class ClientConsole(code.InteractiveConsole):
    """``code.interact`` reading and writing the client, not the process's stdio."""

    def __init__(self, namespace: dict[str, object], io: ClientIO) -> None:
        super().__init__(namespace)
        self.io = io

    def write(self, data: str) -> None:
        self.io.write(data)

    def raw_input(self, prompt: str = "") -> str:
        self.io.write(prompt)
        line = self.io.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")


# thread -> its debugger that continued with breakpoints set (its client stays)
_continued: dict[int, RemotePdb] = {}


def still_attached() -> RemotePdb | None:
    """This thread's debugger that continued with breakpoints set, while its client is
    still there: the thread's next park goes to that client (the listener would refuse
    any other while it is attached)."""
    debugger = _continued.get(threading.get_ident())
    client = debugger.session.client if debugger is not None else None
    if client is not None and alive(client):
        return debugger
    _continued.pop(threading.get_ident(), None)
    return None


def set_trace_remote(session: RemoteSession, frame: FrameType, *, quit_mode: str) -> None:
    """Start a remote pdb stopped in ``frame`` (call this last: see pdb.set_trace)."""
    RemotePdb(session, quit_mode=quit_mode).set_trace(frame)


def post_mortem_remote(session: RemoteSession, tb: TracebackType, *, quit_mode: str) -> None:
    """Inspect ``tb`` over the session's client until it continues or detaches."""
    _interact(session, None, tb, quit_mode, "post-mortem session over")


def inspect_remote(session: RemoteSession, frame: FrameType, *, quit_mode: str) -> None:
    """Inspect ``frame`` (possibly another thread's) without stopping anything."""
    _interact(session, frame, None, quit_mode, "inspection over")


def _interact(
    session: RemoteSession,
    frame: FrameType | None,
    tb: TracebackType | None,
    quit_mode: str,
    farewell: str,
) -> None:
    debugger = RemotePdb(session, quit_mode=quit_mode)
    debugger.reset()
    try:
        debugger.interaction(frame, tb)
    finally:
        session.end(farewell)


def hold_until(hold_seconds: float) -> float | None:
    """When a park that starts now stops waiting (unix seconds); None: it waits for ever."""
    return None if hold_seconds == float("inf") else time.time() + hold_seconds


def _peer(sock: socket.socket) -> str:
    """The debugger client's address, as the listener sees it ("" when unknown)."""
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return ""
    return f"{host}:{port}"
