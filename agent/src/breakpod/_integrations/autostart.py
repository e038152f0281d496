"""Started at interpreter start by ``breakpod_autostart.pth``, with no code change:

* ``BREAKPOD_POST_MORTEM`` true: :func:`post_mortem` -- crashes park;
* ``ENABLE_REMOTE_DEBUG`` true: :func:`job_timeouts` -- torch.distributed's
  process groups get debug mode's timeout policy, watched by the stall watchdog.

Only tiny hooks are installed here; the debugger, pdb and the watchdog are
imported when an exception or a process group actually reaches them, so a
program pays next to nothing at start-up.
"""

import os
import sys
from types import TracebackType

_previous = sys.excepthook


def post_mortem() -> None:
    global _previous
    if not _on("BREAKPOD_POST_MORTEM"):
        return
    if not getattr(sys.excepthook, "__breakpod__", False):
        _previous = sys.excepthook
        sys.excepthook = _lazy_hook


def job_timeouts() -> None:
    if not _on("ENABLE_REMOTE_DEBUG"):
        return
    from breakpod._job import timeouts as job_timeouts

    job_timeouts.install_on_import(on_init=_watch_job)


def _on(name: str) -> bool:
    """The .pth calls here for any value but an off one: a value that is neither on nor
    off is said once here (as everywhere a job reads one), and stays off."""
    if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
        return True  # the common case imports nothing more at start-up
    from breakpod._core.config import env_flag

    return env_flag(name, False)


def _lazy_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        # No post-mortem for Ctrl-C, and no imports here: an import at this
        # point can reset CPython's "exit by SIGINT" flag (status 130).
        _previous(exc_type, exc, tb)
        return
    from breakpod._debug import shim

    sys.excepthook = _previous
    shim.install_excepthook()
    sys.excepthook(exc_type, exc, tb)


def _watch_job() -> None:
    """After ``init_process_group``: the watchdog enforces the user's timeout from now."""
    from breakpod._job import watchdog

    watchdog.start_for_job()


_lazy_hook.__breakpod__ = True  # type: ignore[attr-defined]
