"""Started at interpreter start by ``breakpod_autostart.pth``, with no code change:

* ``BREAKPOD_POST_MORTEM`` true: :func:`post_mortem` -- crashes park;
* ``ENABLE_REMOTE_DEBUG`` true: :func:`job_timeouts` -- torch.distributed's
  process groups get debug mode's timeout policy, watched by the stall watchdog;
  and once ``import torch`` is done, the optimizer's steps are step boundaries and
  the model is found and watched for anomalies (``autowatch.py``), with no code.

Only tiny hooks are installed here; the debugger, pdb and the watchdog are
imported when an exception or a process group actually reaches them, so a
program pays next to nothing at start-up.
"""

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType, TracebackType

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
    after_import("torch", _zero_code)


def after_import(name: str, then: Callable[[], None]) -> None:
    """Run ``then`` once the top-level package ``name`` is imported (now, if it is)."""
    if name in sys.modules:
        then()
    elif not any(isinstance(f, _Then) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Then(name, then))


def _zero_code() -> None:
    from breakpod._integrations import autowatch

    try:
        autowatch.install()
    except Exception as e:  # never break torch's import
        from breakpod._core.announce import announce

        announce(f"debug mode: the zero-code hooks failed ({type(e).__name__}: {e})")


class _Then(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after the package ``name`` has executed."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            run(module)
            then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


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
    from breakpod._debug import breakpoints

    sys.excepthook = _previous
    breakpoints.install_excepthook()
    sys.excepthook(exc_type, exc, tb)


def _watch_job() -> None:
    """After ``init_process_group``: the watchdog enforces the user's timeout from now."""
    from breakpod._job import boundary

    boundary.start_for_job()


_lazy_hook.__breakpod__ = True  # type: ignore[attr-defined]
