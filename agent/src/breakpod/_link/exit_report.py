"""How the process ends, for the session's final ``finished`` event.

``atexit`` does not know the exit status, so it is recorded on the way out:
``sys.exit(n)`` -> ``{"exit": n}``, an uncaught exception -> ``{"exit": 1}``,
otherwise ``{"exit": 0}``. SIGTERM (``docker stop``, a pod's deletion, the
debug image's init forwarding it) -> ``{"signal": 15}``: the handler reports,
then lets the signal kill the process as before (exit status 143). It is
installed only where SIGTERM had its default action, never over the
program's own handler, and only by a process that reports to a broker.

Python runs a handler in the main thread, between two bytecodes: a main thread in
a long C call that retries after a signal (a hung collective, a store's wait)
would not run it until that call ends (minutes; without breakpod the process dies
at once). So the signal's arrival is also written to a wakeup pipe by CPython's
C handler (``signal.set_wakeup_fd``), which an agent thread reads: it reports and
ends the process from there. A forked child (a DataLoader worker) drops the pipe,
which is its parent's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from breakpod._core import threads

REPORT_SECONDS = 3.0  # longest a SIGTERM waits for the report before the process dies
Report = Callable[[dict[str, Any]], None]

_status: dict[str, int] = {"exit": 0}
_installed_pid: int | None = None


def status() -> dict[str, int]:
    """``{"exit": N}`` as far as known now (the atexit report)."""
    return dict(_status)


def install(report: Report) -> None:
    """Record exit statuses, and report SIGTERM through ``report`` (once per process)."""
    global _installed_pid
    if _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    _wrap_exit()
    _wrap_excepthook()
    with contextlib.suppress(ValueError, OSError):  # not the main thread: no handler
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            handler = _on_signal(report)
            signal.signal(signal.SIGTERM, handler)
            _watch_wakeups(handler, report)


def _watch_wakeups(handler: Any, report: Report) -> None:
    """The wakeup pipe and its reader, unless the program has a wakeup fd (asyncio's)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:  # the program's: put back, the handler alone reports
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    os.register_at_fork(after_in_child=lambda: _drop_wakeups(read, write))
    try:
        threads.start_daemon(_read_wakeups, "breakpod-sigterm", read, handler, report)
    except RuntimeError:  # no thread to be had: the handler alone reports
        _drop_wakeups(read, write)


def _read_wakeups(read: int, handler: Any, report: Report) -> None:
    """A byte per signal Python handles, written the moment it arrives. A SIGTERM is
    breakpod's to end while its handler is still the one installed (a program that set
    its own since, to checkpoint and exit, is left to it)."""
    with contextlib.suppress(OSError):
        while data := os.read(read, 64):
            if signal.SIGTERM not in data or os.getpid() != _installed_pid:
                continue
            if signal.getsignal(signal.SIGTERM) is handler:
                _end(int(signal.SIGTERM), report)


def _drop_wakeups(read: int, write: int) -> None:
    with contextlib.suppress(ValueError, OSError):
        if signal.set_wakeup_fd(-1) == write:
            os.close(read)
            os.close(write)


def _wrap_exit() -> None:
    original = sys.exit

    def exit_recording(code: Any = None) -> Any:
        _status["exit"] = code if isinstance(code, int) else (0 if code is None else 1)
        return original(code)

    sys.exit = exit_recording


def _wrap_excepthook() -> None:
    original = sys.excepthook

    def excepthook_recording(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> Any:
        _status["exit"] = 1
        return original(kind, value, tb)

    sys.excepthook = excepthook_recording


def _on_signal(report: Report) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != _installed_pid:  # a forked child (DataLoader worker) stays silent
            _die_of(signum)
        _end(signum, report)

    return handler


_ending = threading.Lock()  # the first of the handler and the pipe's reader ends it


def _end(signum: int, report: Report) -> None:
    """Report the signal (at most ``REPORT_SECONDS``), then die of it; nothing where that
    is under way (the other of the handler and the reader, or a second SIGTERM's handler
    run inside the first's: waiting there would hang it)."""
    if not _ending.acquire(blocking=False):
        return
    # in a thread: the interrupted main thread may hold a lock the report needs
    reporting = threads.start_daemon(_safely, "breakpod-exit-report", report, {"signal": signum})
    reporting.join(REPORT_SECONDS)
    _die_of(signum)


def _die_of(signum: int) -> None:
    """Die of ``signum``, as without breakpod (its default action, from any thread)."""
    try:
        signal.signal(signum, signal.SIG_DFL)
    except ValueError:  # not the main thread: the disposition through libc
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).signal(signum, 0)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal lands meanwhile; should it not have:
    os._exit(128 + signum)


def _safely(report: Report, how: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):  # never let reporting change how the process ends
        report(how)
