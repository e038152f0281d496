"""Debug mode owns the collective timeout: a park never trips the process group's.

With ``ENABLE_REMOTE_DEBUG=1`` (only then) ``torch.distributed.init_process_group``
is wrapped: the default process group gets a long timeout (the user's, or the
hold time plus :data:`ATTACHED_MARGIN`, whichever is longer), and the user's own
timeout (the ``timeout=`` argument, else torch's default for the backend) is
kept in :data:`user_timeout`. The stall watchdog enforces it while no rank of
the job is parked: a rank that waits in one collective longer than that
reports the stall and exits with status 1, as the process group would have.

The wrapper is installed at interpreter start by ``breakpod_autostart.pth``
(:func:`breakpod._integrations.autostart.job_timeouts`, which hands in the watchdog's start)
(an import hook that patches ``torch.distributed`` once it is imported), or by
:func:`install` when torch is already imported. Debug mode off: nothing is
wrapped, no hook is registered.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.config import ENV, Settings, env_flag

ATTACHED_MARGIN = 1800.0  # an attached session may last this long past the hold time
DEFAULT_HOLD = 300.0
LONGEST_TIMEOUT = 365 * 24 * 3600.0  # seconds: "forever", for a process group
user_timeout: float | None = None  # seconds: the process group's own, while wrapped


def debug_mode(env: Any = None) -> bool:
    """``ENABLE_REMOTE_DEBUG`` as every part of breakpod reads it (the ``.pth`` too)."""
    return env_flag(ENV["enabled"], False, env)


OnInit = Callable[[], None]
_on_init: OnInit | None = None  # what runs after the process group exists (the watchdog)


def install(on_init: OnInit | None = None) -> bool:
    """Wrap ``init_process_group`` of an imported ``torch.distributed``; False when off."""
    module = sys.modules.get("torch.distributed")
    if not debug_mode() or module is None:
        return False
    _set_on_init(on_init)
    _wrap(module)
    return True


def install_on_import(on_init: OnInit | None = None) -> None:
    """For the ``.pth``: wrap ``torch.distributed`` when it is imported (debug mode only)."""
    if not debug_mode():
        return
    _set_on_init(on_init)
    if "torch.distributed" in sys.modules:
        install()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _set_on_init(on_init: OnInit | None) -> None:
    global _on_init
    if on_init is not None:
        _on_init = on_init


def parked_timeout(user: float) -> float:
    """The timeout the process group gets in debug mode: room for a whole park (a hold
    with no limit gets a year: the process group's timeout must be a number)."""
    return min(max(user, _hold_seconds() + ATTACHED_MARGIN), LONGEST_TIMEOUT)


def wrapped(module: ModuleType) -> bool:
    return hasattr(getattr(module, "init_process_group", None), "__breakpod_original__")


def _wrap(module: ModuleType) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or wrapped(module):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        global user_timeout
        try:
            bound = signature.bind(*args, **kwargs)
            asked = bound.arguments.get("timeout")
            user = asked or _default_timeout(module, bound.arguments.get("backend"))
            user_timeout = user.total_seconds()
            bound.arguments["timeout"] = datetime.timedelta(seconds=parked_timeout(user_timeout))
            args, kwargs = bound.args, bound.kwargs
        except Exception:  # arguments torch itself will refuse, in its own words
            pass
        result = original(*args, **kwargs)
        if _on_init is not None:
            try:
                _on_init()
            except Exception as e:  # the group is made: the job goes on without it
                announce(f"stall detection could not start with the process group ({e})")
        return result

    init_process_group.__breakpod_original__ = original  # type: ignore[attr-defined]
    module.init_process_group = init_process_group  # type: ignore[attr-defined]


def _default_timeout(module: ModuleType, backend: Any) -> datetime.timedelta:
    c10d = getattr(module, "distributed_c10d", None)
    try:
        found: datetime.timedelta = c10d._get_default_timeout(module.Backend(backend or "gloo"))  # type: ignore[union-attr]
        return found
    except Exception:  # an older or newer torch: its documented default
        return datetime.timedelta(minutes=30)


def _hold_seconds() -> float:
    try:
        return float(Settings.load()[0].hold_seconds)
    except Exception:  # bad settings are announced where they are used
        return DEFAULT_HOLD


class _Finder(importlib.abc.MetaPathFinder):
    """Runs :func:`_wrap` right after ``torch.distributed`` executes."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader.exec_module = _then_wrap(spec.loader.exec_module)  # type: ignore[method-assign,assignment]
        return spec


def _then_wrap(exec_module: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        exec_module(module)
        with contextlib.suppress(Exception):  # never break torch's import
            _wrap(module)

    return run
