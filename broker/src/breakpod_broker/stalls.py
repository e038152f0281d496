"""A job's stall report names its culprit on every stalled rank of the job.

Rank 0 sends the job-wide report (a ``stall`` event with ``scope: job``, the
culprit ranks and every rank's record); each rank's own ``stall`` event says
only where that rank is. So that any rank's session, in ``breakpod sessions`` or
on the dashboard, says whom the job waits for, the report's culprit line is
written into the ``culprit`` field of each session of the job that is stalled
when it arrives (a field that lasts as long as the state: scripts.STATE_EXTRAS).

A rank's own event may arrive after the report (its sender flushed later, on a loaded
node): its session then takes the line from the job's last report, if that report
found the rank at the step its own event names (the same stall, not an earlier one).
"""

from __future__ import annotations

import json
from typing import Any

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.context import Broker
from breakpod_broker.models import SessionOut

CHUNK = 500  # a job's sessions read per round trip


def culprit_line(fields: dict[str, Any]) -> str | None:
    """ "rank 1 at train.py:50 in slow (step 7, in user code)" from a job-wide report;
    None for any other stall event, or a report that blames nobody."""
    if fields.get("scope") != "job" or not isinstance(fields.get("ranks"), list):
        return None
    blamed = [r for r in fields.get("culprits") or [] if isinstance(r, int)]
    if not blamed:
        return None
    records = {r.get("rank"): r for r in fields["ranks"] if isinstance(r, dict)}
    first = records.get(blamed[0], {})
    names = ("rank " if len(blamed) == 1 else "ranks ") + ", ".join(map(str, blamed))
    doing = _doing(first)
    where = f" at {first['frame']}" if first.get("frame") else ""
    step = f"step {first['step']}, " if isinstance(first.get("step"), int) else ""
    return f"{names}{where} ({step}{doing})"[:2000]


def _doing(record: dict[str, Any]) -> str:
    state = record.get("state")
    if state == "collective":
        return f"in collective #{record.get('entered')} ({record.get('op') or '?'})"
    if state == protocol.PARKED:
        return protocol.PARKED
    return "waiting for a parked rank" if state == "waiting-for-peer" else "in user code"


async def blame(
    broker: Broker, events: list[dict[str, Any]], sessions: dict[str, SessionOut]
) -> None:
    """Write each job-wide report's culprit line on the job's stalled sessions."""
    for event in events:
        session = sessions.get(event["session"])
        if event["kind"] != protocol.STALL or session is None or not session.job:
            continue
        fields = event.get("fields") or {}
        line = culprit_line(fields)
        if line is not None:
            await _remember(broker, session, fields, line)
            await _mark(broker, session.job, session.namespace, line)
        elif fields.get("scope") != "job":
            await _late_rank(broker, event["session"], session, fields)


async def _remember(broker: Broker, session: SessionOut, fields: dict[str, Any], line: str) -> None:
    """The report's line and each rank's step, for the ranks whose own event comes later."""
    steps = {
        str(r["rank"]): r.get("step")
        for r in fields["ranks"]
        if isinstance(r, dict) and isinstance(r.get("rank"), int)
    }
    key = keys.job_stall(session.namespace or "", session.job or "")
    async with broker.redis.pipeline(transaction=False) as pipe:
        pipe.hset(key, mapping={"line": line, "steps": json.dumps(steps)})
        pipe.expire(key, broker.settings.retention_seconds)
        await pipe.execute()


async def _late_rank(
    broker: Broker, session_id: str, session: SessionOut, fields: dict[str, Any]
) -> None:
    """A rank's own stall, after the job's report on it: the report's culprit line."""
    rank, step = fields.get("rank"), fields.get("step")
    if not isinstance(rank, int) or not isinstance(step, int):
        return
    key = keys.job_stall(session.namespace or "", session.job or "")
    line, steps = await broker.redis.hmget(key, "line", "steps")
    if line is None or steps is None:
        return
    try:
        if json.loads(steps).get(str(rank)) != step:
            return  # a report on another stall
    except (ValueError, AttributeError):
        return
    state = await broker.redis.hget(keys.session(session_id), "state")
    if state == protocol.STATE_OF_KIND[protocol.STALL]:
        await broker.redis.hset(keys.session(session_id), "culprit", line)


async def _mark(broker: Broker, job: str, namespace: str | None, line: str) -> None:
    index = keys.job_sessions(job)
    start = 0
    while True:
        ids = await broker.redis.zrange(index, start, start + CHUNK - 1)
        async with broker.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(keys.session(session_id), "state", "namespace")
            found = await pipe.execute()
        stalled = [
            i
            for i, (state, ns) in zip(ids, found, strict=True)
            if state == protocol.STATE_OF_KIND[protocol.STALL] and (ns or None) == namespace
        ]
        async with broker.redis.pipeline(transaction=False) as pipe:
            for session_id in stalled:
                pipe.hset(keys.session(session_id), "culprit", line)
            await pipe.execute()
        if len(ids) < CHUNK:
            return
        start += CHUNK
