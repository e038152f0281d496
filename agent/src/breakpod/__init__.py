"""breakpod: ``breakpoint()`` for pods.

The stable API is ``__all__``. Importing ``breakpod`` is cheap: it loads
neither torch nor debugpy, and each name below is imported on first use.

    PYTHONBREAKPOINT=breakpod.set_trace    # breakpoint() parks on a socket when headless
    breakpod.init_remote_debugger()        # a pdb or debugpy listener, when enabled
    breakpod.install_excepthook()          # post-mortem on crashes (BREAKPOD_POST_MORTEM=1)
    monitor = breakpod.watch(model)        # tensor monitors: NaN/Inf, shapes, grads, dead units
    breakpod.step()                        # a step boundary: stall detection, a `break` parks here
    breakpod.break_if_requested()          # park after a `break` (no stall detection)
    breakpod.emit("log", message="...")    # an event for the broker (when one is configured)
    breakpod.export.tensorboard("runs/x")  # the monitors' stats in TensorBoard (or .mlflow())
    with breakpod.phase("forward"): ...    # the training health toolkit: breakpod.health
    breakpod.break_if(loss_is_bad, every=10)  # park when a tensor condition holds

This face is also where the layers meet: it installs the broker link in
``breakpod._core.wiring`` and the monitors' tensor commands in the debugger's
command registry (``breakpod._debug.registry``), so the layers below use them
without importing them.
"""

from __future__ import annotations

import importlib
import os
import sys

from breakpod._core import wiring
from breakpod._debug import registry

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

__version__ = "0.1.0"

_EXPORTS = {
    "set_trace": "breakpod._debug.breakpoints",
    "post_mortem": "breakpod._debug.breakpoints",
    "install_excepthook": "breakpod._debug.breakpoints",
    "init_remote_debugger": "breakpod._api",
    "break_if_requested": "breakpod._job.boundary",
    "emit": "breakpod._core.events",
    "watch_stalls": "breakpod._job.boundary",
    "heartbeat": "breakpod._job.boundary",
    "step": "breakpod._job.boundary",
    "Endpoint": "breakpod._debug.debugger",
    "Settings": "breakpod._core.config",
    "BreakpodError": "breakpod._core.errors",
    "ConfigError": "breakpod._core.errors",
    "InsecureBindError": "breakpod._core.errors",
    "ListenerError": "breakpod._core.errors",
    "AttachError": "breakpod._core.errors",
    "watch": "breakpod._monitor.monitor",
    "Monitor": "breakpod._monitor.monitor",
    "Anomaly": "breakpod._monitor.anomaly",
    "summary": "breakpod._monitor.summaries",
    "RuleError": "breakpod._core.errors",
    "AnomalyError": "breakpod._core.errors",
    "phase": "breakpod.health._phases",
    "break_if": "breakpod.health._break_if",
}
_SUBPACKAGES = ("export", "health")  # public subpackages, imported on first use

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES, "__version__"])

if TYPE_CHECKING:
    from typing import Any

    from breakpod._api import init_remote_debugger as init_remote_debugger
    from breakpod._core.config import Settings as Settings
    from breakpod._core.errors import AnomalyError as AnomalyError
    from breakpod._core.errors import AttachError as AttachError
    from breakpod._core.errors import BreakpodError as BreakpodError
    from breakpod._core.errors import ConfigError as ConfigError
    from breakpod._core.errors import InsecureBindError as InsecureBindError
    from breakpod._core.errors import ListenerError as ListenerError
    from breakpod._core.errors import RuleError as RuleError
    from breakpod._core.events import emit as emit
    from breakpod._debug.breakpoints import install_excepthook as install_excepthook
    from breakpod._debug.breakpoints import post_mortem as post_mortem
    from breakpod._debug.breakpoints import set_trace as set_trace
    from breakpod._debug.debugger import Endpoint as Endpoint
    from breakpod._job.boundary import break_if_requested as break_if_requested
    from breakpod._job.boundary import heartbeat as heartbeat
    from breakpod._job.boundary import step as step
    from breakpod._job.boundary import watch_stalls as watch_stalls
    from breakpod._monitor.anomaly import Anomaly as Anomaly
    from breakpod._monitor.monitor import Monitor as Monitor
    from breakpod._monitor.monitor import watch as watch
    from breakpod._monitor.summaries import summary as summary
    from breakpod.health._break_if import break_if as break_if
    from breakpod.health._phases import phase as phase


def _connect_broker() -> Any:
    """What a park, a listener or a monitor asks for through :mod:`breakpod._core.wiring`.

    In a job of several ranks the job layer hears the park (the other ranks
    pause); with ``BREAKPOD_BROKER_URL`` set the broker link starts. Imported on
    first use, so neither ``import breakpod`` nor a lone job without a broker pays.
    """
    from breakpod._core.config import BROKER_URL_ENV

    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
        from breakpod._job import boundary

        boundary.hear_parks()  # a park here pauses the job's other ranks
    if not os.environ.get(BROKER_URL_ENV):
        return None
    from breakpod._link import emitter

    return emitter.connect()


def _tensor_commands() -> None:
    """pdb's tensor commands (``tstat``, ``tnan``, ...) in every session once torch is
    loaded (never loading it for them)."""
    if "torch" in sys.modules:
        from breakpod._monitor.tensor_commands import TENSOR_COMMANDS

        TENSOR_COMMANDS.register()


wiring.provide(_connect_broker)
registry.add_loader(_tensor_commands)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext breakpod``: the ``%breakpod`` magic (sessions, watch, attach, debug).

    Looked up by name, as the lazy names are: the face stays below the integrations."""
    importlib.import_module("breakpod._integrations.jupyter").load(ipython)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"breakpod.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'breakpod' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
