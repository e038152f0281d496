"""Started at interpreter start by ``breakpod_autostart.pth``, with no code change:

* ``BREAKPOD_POST_MORTEM`` true: :func:`post_mortem` -- crashes park;
* ``ENABLE_REMOTE_DEBUG`` true: :func:`job_timeouts` -- torch.distributed's
  process groups get debug mode's timeout policy, watched by the stall watchdog.

Only tiny hooks are installed here; the debugger, pdb and the watchdog are
imported when an exception or a process group actually reaches them, so a
program pays next to nothing at start-up.
"""

import sys
from types import TracebackType

_previous = sys.excepthook


def post_mortem() -> None:
    global _previous
    if not getattr(sys.excepthook, "__breakpod__", False):
        _previous = sys.excepthook
        sys.excepthook = _lazy_hook


def job_timeouts() -> None:
    from breakpod._job import timeouts as job_timeouts

    job_timeouts.install_on_import(on_init=_watch_job)


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
