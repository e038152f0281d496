"""Why a process died, as its runtime tells: the sessions it ran, and the event that says so.

The engine and pod watches (docker_watch.py, pod_watch.py) turn what the runtime
reports into ``(kind, fields)`` (:func:`of_exit`) and record it here on each live
session of the container or pod: a ``killed`` event (OOMKilled, Evicted, a
signal) or a ``finished`` one with the exit status. It goes through the ordinary
ingest, so the first word on how a session ended is kept (scripts.py): the
agent's own exit report, when it got out, stays; the runtime's fills in when the
process could say nothing (SIGKILL, the OOM killer, a lost node). The event id
is the runtime's own (container and time, pod uid), so replicas that each watch
record it once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.context import Broker
from breakpod_broker.events import ingest
from breakpod_broker.models import EventIn
from breakpod_broker.sessions import read_many

log = logging.getLogger(__name__)
CHUNK = 500  # sessions read per round trip while looking for a container's or pod's
FIELDS = ("container", "host", "pod", "namespace", "state")


def of_exit(code: int | None, *, oom: bool = False, reason: str = "") -> tuple[str, dict[str, Any]]:
    """The event for a process that ended with ``code``: the runtime's ``reason`` (or
    OOMKilled) or a signal (exit > 128) -> killed; else finished with the exit status."""
    if oom:
        reason = "OOMKilled"
    if not reason and code is not None and code > 128:
        number = code - 128
        reason = f"signal {number} ({protocol.SIGNAL_NAMES.get(number, 'signal')})"
    if reason:
        return protocol.KILLED, {"reason": reason, **({"exit": code} if code is not None else {})}
    return protocol.FINISHED, {protocol.EXIT_FIELD: code if code is not None else -1}


async def sessions_where(
    broker: Broker, index: str, match: Callable[[dict[str, str]], bool]
) -> list[str]:
    """Ids of the sessions in ``index`` whose stored fields ``match`` (FIELDS only)."""
    found: list[str] = []
    start = 0
    while True:
        ids = await broker.redis.zrange(index, start, start + CHUNK - 1)
        async with broker.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(keys.session(session_id), *FIELDS)
            rows = await pipe.execute()
        for session_id, values in zip(ids, rows, strict=True):
            fields = {k: v for k, v in zip(FIELDS, values, strict=True) if v is not None}
            if fields and match(fields):
                found.append(session_id)
        if len(ids) < CHUNK:
            return found
        start += CHUNK


async def record(
    broker: Broker, session_ids: list[str], kind: str, fields: dict[str, Any], event_id: str
) -> int:
    """Record the runtime's word on each session that has not ended; how many got it."""
    sessions = [s for s in await read_many(broker, session_ids) if s is not None]
    live = {s.id: s for s in sessions if s.state not in protocol.FINAL_STATES}
    if not live:
        return 0
    events = [
        EventIn(id=event_id, session=sid, kind=kind, time=None, fields=fields)  # type: ignore[arg-type]
        for sid in live
    ]
    reply = await ingest(broker, events, live)
    if reply.accepted:
        log.info("%s %s: %s", kind, ", ".join(live), fields)
    return reply.accepted
