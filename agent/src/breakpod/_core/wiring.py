"""The one slot through which the layers below ask for the broker link.

A park, a listener, a monitor or the stall watchdog calls :func:`connect`
("this process is worth reporting") without knowing who reports it. The
package's face (``breakpod/__init__.py``) fills the slot with a function that
starts the broker emitter when ``BREAKPOD_BROKER_URL`` is set. This module
imports nothing, so ``import breakpod`` stays cheap.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol

    class Link(Protocol):
        def flush(self, timeout: float = ...) -> bool: ...

        def finish(self, how: dict[str, int] | None = ...) -> None: ...


_connector: Callable[[], Link | None] | None = None


def provide(connector: Callable[[], Link | None]) -> None:
    """Install what :func:`connect` runs (the package's face does, once)."""
    global _connector
    _connector = connector


def connect() -> Link | None:
    """Start reporting to the broker, when one is configured; never raises."""
    if _connector is None:
        return None
    try:
        return _connector()
    except Exception:  # reporting is optional: the job goes on without it
        return None


def flush(seconds: float) -> None:
    """Deliver what was reported, before an exit the job did not choose; never raises."""
    link = connect()
    try:
        if link is not None:
            link.flush(seconds)
    except Exception:
        return


def finish(how: dict[str, int]) -> None:
    """Report this process finished, as ``how`` (``{"exit": 1}``), before an ``os._exit``
    that skips the exit handlers that would; never raises."""
    link = connect()
    try:
        if link is not None:
            link.finish(how)
    except Exception:
        return
