"""Public entry points that compose the layers below (``breakpod.<name>`` resolves here).

Each layer stays ignorant of the ones above it; the composition lives here:
a listener that should wait for a client parks (``_debug/breakpoints.py``).
"""

from __future__ import annotations

import sys
from types import FrameType

from breakpod import protocol
from breakpod._core.announce import announce
from breakpod._core.config import Settings, format_seconds
from breakpod._core.errors import InsecureBindError
from breakpod._debug import breakpoints, debugger
from breakpod._debug.debugger import Endpoint


def init_remote_debugger(
    port: int | None = None,
    host: str | None = None,
    backend: str | None = None,
    wait: bool = False,
    *,
    enable: bool | None = None,
) -> Endpoint | None:
    """Get a debugger listener ready in this process, or do nothing when disabled.

    Disabled (the default) unless ``ENABLE_REMOTE_DEBUG`` is true or
    ``enable=True``. ``backend`` is ``"auto"`` (debugpy when importable, else
    pdb; also read from ``BREAKPOD_BACKEND``), ``"pdb"`` or ``"debugpy"``.
    The port is ``port`` (or ``BREAKPOD_PORT``, default 5678) plus
    ``LOCAL_RANK``. ``wait=True`` blocks until a client attaches, at most
    ``BREAKPOD_WAIT_TIMEOUT`` seconds. Returns where the listener is, or
    ``None`` when disabled or when the listener could not start (logged).
    Raises :class:`ConfigError` for an ``enable`` that is neither yes nor no (text
    is read as ``ENABLE_REMOTE_DEBUG`` is) or a ``port`` outside 0..65535, and
    :class:`InsecureBindError` for a ``host`` beyond loopback without the
    token (pdb) or the opt-in (debugpy) such a bind needs; the same bind asked
    by ``BREAKPOD_HOST`` is announced instead, and no listener starts.
    """
    settings, fallbacks = Settings.for_listener(
        port=port, host=host, backend=backend, enable=enable
    )
    try:
        endpoint = debugger.start_listener(settings, fallbacks, breakpoints.set_trace)
    except InsecureBindError as e:
        if host is not None:  # asked for in code: the caller hears it there
            raise
        # from BREAKPOD_HOST: as any bad security setting, said once, and no listener
        announce(f"{e}; no debugger listener in this process")
        return None
    if endpoint is not None and wait:
        _wait_for_client(endpoint, settings, sys._getframe(1))
    return endpoint


def _wait_for_client(endpoint: Endpoint, settings: Settings, frame: FrameType) -> None:
    if endpoint.backend == protocol.DEFAULT_LISTENER:
        reason = "init_remote_debugger(wait=True)"
        breakpoints.park_here(frame, settings, reason, hold_seconds=settings.wait_timeout)
    elif not debugger.wait_for_debugpy_client(settings.wait_timeout):
        announce(f"nobody attached within {format_seconds(settings.wait_timeout)}; continuing")
