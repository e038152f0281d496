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
import sys
import threading
from types import FrameType, TracebackType

from breakpod._core.announce import announce
from breakpod._core.config import format_seconds
from breakpod._debug.listener import ClientIO, alive
from breakpod._debug.park import PdbPark
from breakpod._debug.pdb_commands import CommandsMixin
from breakpod._debug.registry import load_commands

# Stepping never stops inside breakpod or torch (like "just my code"): `s` on
# model(x) lands in the user's forward(), and a park started from a torch hook
# (an optimizer step hook) stops at the training loop's next line. Breakpoints
# set explicitly in those files still stop.
SKIP = ["breakpod", "breakpod.*", "torch", "torch.*"]


class RemotePdb(CommandsMixin):
    """pdb bound to a park's client (:class:`PdbPark`) instead of stdin/stdout."""

    def __init__(
        self,
        park: PdbPark,
        *,
        quit_mode: str = "detach",
    ) -> None:
        super().__init__(stdin=park.io, stdout=park.io, skip=SKIP, nosigint=True)  # type: ignore[arg-type]
        self.park = park
        self.quit_mode = quit_mode
        self.prompt = "(Pdb) "
        load_commands()

    def do_continue(self, arg: str) -> bool:
        stop = bool(super().do_continue(arg))
        if not self.breaks:
            _continued.pop(threading.get_ident(), None)
            self.park.end("continuing; the debugger detached")
            self.park.resumed()
        else:  # the client stays, for the breakpoints and the thread's next park
            _continued[threading.get_ident()] = self
        return stop

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool:
        if self.quit_mode == "exit":
            self.park.end("quitting: the program will stop (BREAKPOD_QUIT=exit)")
            return bool(super().do_quit(arg))
        self.message(
            "breakpod: detaching; the program continues (BREAKPOD_QUIT=exit makes q stop it)"
        )
        self.clear_all_breaks()
        return self.do_continue(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:
        idled = self.park.io.idled
        self.park.end(self._idle_notice() if idled else "client disconnected")
        if (idled or self.park.on_detach == "wait") and self.park.wait():
            self.print_stack_entry(self.stack[self.curindex])
            return False
        return self.do_continue(arg)

    def _idle_notice(self) -> str:
        """Said when an idle client is dropped; the park then waits for another one."""
        idle = format_seconds(self.park.io.idle_seconds)
        hold = format_seconds(self.park.hold_seconds)
        notice = f"the debugger client sent nothing for {idle} and was dropped"
        announce(f"{notice}; waiting up to {hold} for a debugger again")
        return notice

    def do_interact(self, arg: str) -> None:
        """interact: start an interactive interpreter over this connection."""
        frame = self.curframe
        assert frame is not None
        console = ClientConsole({**frame.f_globals, **self.curframe_locals}, self.park.io)
        saved, sys.stdout = sys.stdout, self.park.io
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
    client = debugger.park.client if debugger is not None else None
    if client is not None and alive(client):
        return debugger
    _continued.pop(threading.get_ident(), None)
    return None


def trace(park: PdbPark, frame: FrameType, *, quit_mode: str) -> None:
    """Start a remote pdb stopped in ``frame`` (call this last: see pdb.set_trace)."""
    RemotePdb(park, quit_mode=quit_mode).set_trace(frame)


def post_mortem(park: PdbPark, tb: TracebackType, *, quit_mode: str) -> None:
    """Inspect ``tb`` over the park's client until it continues or detaches."""
    _interact(park, None, tb, quit_mode, "post-mortem session over")


def inspect(park: PdbPark, frame: FrameType, *, quit_mode: str) -> None:
    """Inspect ``frame`` (possibly another thread's) without stopping anything."""
    _interact(park, frame, None, quit_mode, "inspection over")


def _interact(
    park: PdbPark,
    frame: FrameType | None,
    tb: TracebackType | None,
    quit_mode: str,
    farewell: str,
) -> None:
    debugger = RemotePdb(park, quit_mode=quit_mode)
    debugger.reset()
    try:
        debugger.interaction(frame, tb)
    finally:
        park.end(farewell)
