"""In-process event hub: parks, listeners and monitors publish; sinks consume.

A sink is any callable taking an :class:`Event` (the broker emitter is one).
Publishing with no sinks costs one empty-list check. A sink that raises is
logged once and never affects the caller.

The hub also carries the one request that travels the other way: a ``break``
from the broker (:func:`request_break`), read at the next step boundary
(:func:`pending_break`). Layers below the broker link publish and read here and
never import it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

log = logging.getLogger(__name__)


class Event(NamedTuple):  # not a dataclass: a tenth of its cost on a cold breakpoint()
    kind: str
    fields: dict[str, Any]
    time: float


Sink = Callable[[Event], None]
T = TypeVar("T")
_sinks: list[Sink] = []
_failed: set[int] = set()


def add_sink(sink: Sink) -> None:
    _add(_sinks, sink)


def remove_sink(sink: Sink) -> None:
    _remove(_sinks, sink)


def emit(kind: str, **fields: Any) -> None:
    if _sinks:
        for enrich in _enrichers.get(kind, ()):
            _enrich(enrich, fields)
        _deliver(_sinks, Event(kind, fields, time.time()))


# What some kinds carry besides their own fields, from a layer above the emitter
# (the flight recorder's dump rides on every anomaly and stall event).
Enricher = Callable[[], dict[str, Any]]
_enrichers: dict[str, list[Enricher]] = {}


def add_enricher(kinds: tuple[str, ...], enrich: Enricher) -> None:
    """``enrich()``'s fields join each event of ``kinds`` (only when some sink listens)."""
    for kind in kinds:
        _add(_enrichers.setdefault(kind, []), enrich)


def _enrich(enrich: Enricher, fields: dict[str, Any]) -> None:
    extra = _contained("enricher", enrich)
    for key, value in (extra or {}).items():
        fields.setdefault(key, value)  # never over the event's own fields


# Local topics never leave the process (the broker link is a plain sink and never
# sees them): per-step statistics for in-process exporters.
STEP_STATS = "step_stats"
_local_sinks: list[Sink] = []


def add_local_sink(sink: Sink) -> None:
    _add(_local_sinks, sink)


def remove_local_sink(sink: Sink) -> None:
    _remove(_local_sinks, sink)


def emit_local(kind: str, **fields: Any) -> None:
    """Like :func:`emit`, to local sinks only; with none it costs one empty-list check."""
    if _local_sinks:
        _deliver(_local_sinks, Event(kind, fields, time.time()))


def _add(items: list[T], item: T) -> None:
    if item not in items:
        items.append(item)


def _remove(sinks: list[Sink], sink: Sink) -> None:
    if sink in sinks:
        sinks.remove(sink)


def _deliver(sinks: list[Sink], event: Event) -> None:
    for sink in list(sinks):
        _contained("sink", sink, event)


def _contained(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None when it raised (logged once per callable, never to the caller)."""
    try:
        return fn(*args)
    except Exception:
        if id(fn) not in _failed:
            _failed.add(id(fn))
            log.exception("breakpod event %s %r failed; further failures are silent", what, fn)
        return None


# A plain flag, not a threading.Event: pending_break() runs right after a park at the same
# boundary, and a debugger stepping there would stop in threading.py's is_set().
_break_requested = False


def request_break() -> None:
    """What a ``break`` command does: the next step boundary parks."""
    global _break_requested
    _break_requested = True


# The last training step this process reached (the stall watchdog's count), read by
# the broker link's heartbeat: the broker shows each rank's lag behind its job's
# furthest rank, so a straggler shows before it stalls. A plain int: one store a step.
_last_step: int | None = None


def note_step(step: int) -> None:
    global _last_step
    _last_step = step


def last_step() -> int | None:
    return _last_step


def pending_break() -> bool:
    """True once after a ``break`` was requested (then cleared). Costs one flag check."""
    global _break_requested
    if not _break_requested:
        return False
    _break_requested = False
    return True
