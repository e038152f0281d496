"""How the process ends, for the session's final ``finished`` event.

``atexit`` does not know the exit status, so it is recorded on the way out:
``sys.exit(n)`` -> ``{"exit": n}``, an uncaught exception -> ``{"exit": 1}``,
otherwise ``{"exit": 0}``. SIGTERM (``docker stop``, a pod's deletion, the
debug image's init forwarding it) -> ``{"signal": 15}``: the handler reports,
then lets the signal kill the process as before (exit status 143). It is
installed only where SIGTERM had its default action, never over the
program's own handler, and only by a process that reports to a broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
            signal.signal(signal.SIGTERM, _on_signal(report))


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
        if os.getpid() == _installed_pid:  # a forked child (DataLoader worker) stays silent
            # in a thread: the interrupted main thread may hold a lock the report needs
            fields = {"signal": signum}
            reporting = threads.start_daemon(_safely, "breakpod-exit-report", report, fields)
            reporting.join(REPORT_SECONDS)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of it, as without breakpod

    return handler


def _safely(report: Report, how: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):  # never let reporting change how the process ends
        report(how)
