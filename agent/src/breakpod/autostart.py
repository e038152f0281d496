"""Imported at interpreter start by ``breakpod_autostart.pth`` when
``BREAKPOD_POST_MORTEM`` is true, so crashes park with no code change.

Only a tiny hook is installed here; the debugger (and pdb) are imported when
an exception actually reaches it, so a program that never crashes pays
nothing at start-up.
"""

import sys
from types import TracebackType


def _lazy_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        # No post-mortem for Ctrl-C, and no imports here: an import at this
        # point can reset CPython's "exit by SIGINT" flag (status 130).
        _previous(exc_type, exc, tb)
        return
    from breakpod import shim

    sys.excepthook = _previous
    shim.install_excepthook()
    sys.excepthook(exc_type, exc, tb)


_lazy_hook.__breakpod__ = True  # type: ignore[attr-defined]
_previous = sys.excepthook
sys.excepthook = _lazy_hook
