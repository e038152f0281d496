"""breakpod: ``breakpoint()`` for pods.

The stable API is ``__all__``. Importing ``breakpod`` is cheap: it loads
neither torch nor debugpy, and each name below is imported on first use.

    PYTHONBREAKPOINT=breakpod.set_trace    # breakpoint() parks on a socket when headless
    breakpod.init_remote_debugger()        # a pdb or debugpy listener, when enabled
    breakpod.install_excepthook()          # post-mortem on crashes (BREAKPOD_POST_MORTEM=1)
    monitor = breakpod.watch(model)        # tensor monitors: NaN/Inf, shapes, grads, dead units
    breakpod.step()                        # a step boundary: stall detection (BREAKPOD_STALL_AFTER)
    breakpod.break_if_requested()          # your own loop's step boundary: park after a `break`
    breakpod.emit("log", message="...")    # an event for the broker (when one is configured)

This face is also where the layers meet: it installs the broker link in
``breakpod.wiring``, so the layers below ask for it without importing it.
"""

from __future__ import annotations

import importlib
import os

from breakpod import wiring

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

__version__ = "0.1.0"

_EXPORTS = {
    "set_trace": "breakpod.shim",
    "post_mortem": "breakpod.shim",
    "install_excepthook": "breakpod.shim",
    "init_remote_debugger": "breakpod.api",
    "break_if_requested": "breakpod.api",
    "emit": "breakpod.events",
    "watch_stalls": "breakpod.watchdog",
    "heartbeat": "breakpod.watchdog",
    "step": "breakpod.watchdog",
    "Endpoint": "breakpod.debugger",
    "Settings": "breakpod.config",
    "BreakpodError": "breakpod.errors",
    "ConfigError": "breakpod.errors",
    "InsecureBindError": "breakpod.errors",
    "ListenerError": "breakpod.errors",
    "AttachError": "breakpod.errors",
    "watch": "breakpod.monitor",
    "Monitor": "breakpod.monitor",
    "Anomaly": "breakpod.anomaly",
    "summary": "breakpod.summaries",
    "RuleError": "breakpod.errors",
    "AnomalyError": "breakpod.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from typing import Any

    from breakpod.anomaly import Anomaly as Anomaly
    from breakpod.api import break_if_requested as break_if_requested
    from breakpod.api import init_remote_debugger as init_remote_debugger
    from breakpod.config import Settings as Settings
    from breakpod.debugger import Endpoint as Endpoint
    from breakpod.errors import AnomalyError as AnomalyError
    from breakpod.errors import AttachError as AttachError
    from breakpod.errors import BreakpodError as BreakpodError
    from breakpod.errors import ConfigError as ConfigError
    from breakpod.errors import InsecureBindError as InsecureBindError
    from breakpod.errors import ListenerError as ListenerError
    from breakpod.errors import RuleError as RuleError
    from breakpod.events import emit as emit
    from breakpod.monitor import Monitor as Monitor
    from breakpod.monitor import watch as watch
    from breakpod.shim import install_excepthook as install_excepthook
    from breakpod.shim import post_mortem as post_mortem
    from breakpod.shim import set_trace as set_trace
    from breakpod.summaries import summary as summary
    from breakpod.watchdog import heartbeat as heartbeat
    from breakpod.watchdog import step as step
    from breakpod.watchdog import watch_stalls as watch_stalls


def _connect_broker() -> Any:
    """What a park, a listener or a monitor asks for through :mod:`breakpod.wiring`.

    In a job of several ranks the job layer hears the park (the other ranks
    pause); with ``BREAKPOD_BROKER_URL`` set the broker link starts. Imported on
    first use, so neither ``import breakpod`` nor a lone job without a broker pays.
    """
    from breakpod.config import BROKER_URL_ENV

    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):
        importlib.import_module("breakpod.watchdog")  # its hub sink pauses the peers
    if not os.environ.get(BROKER_URL_ENV):
        return None
    from breakpod import reporting

    return reporting.connect()


wiring.provide(_connect_broker)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'breakpod' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
