"""``GET /v1/sessions``: sessions page by page, filtered in the broker before any cap.

Sessions are listed newest registration first from a sorted set (all sessions,
one namespace's or one job's: keys.SESSIONS and its narrowed twins). A page
walks the index from its cursor, reading the sessions' hashes chunk by chunk,
until ``limit`` pass the filters or it has read ``SCAN_BUDGET`` entries; the
``next`` cursor continues exactly after the last entry read. Heartbeats do not
move a session in the index, so paging never skips or repeats one.

``counts`` holds, per state, the sessions the filters other than ``state``
select. They are counted from every session in scope: exactly on each request
while the scope holds fewer than ``COUNT_INLINE_BELOW``; above, from a per-replica
cache refreshed in the background every ``COUNTS_SECONDS``, or one second per
``COUNTS_PER_SECOND`` sessions in scope when more (a page never waits; the count
shares the replica's loop with the pages, so 10,000 sessions recounted every 2 s
would cost it 20,000 Redis replies each time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.auth import Viewer
from breakpod_broker.context import Broker, BrokerDep
from breakpod_broker.models import SessionOut
from breakpod_broker.sessions import read_many
from breakpod_broker.tokens import Principal

router = APIRouter(tags=["sessions"])
CHUNK = 500  # index entries read per round trip
SCAN_BUDGET = 20_000  # index entries one page may read; ``next`` continues after them
COUNT_CHUNK = 500  # small round trips: the refresh shares the loop with requests
COUNTS_SECONDS = 2.0
COUNTS_PER_SECOND = 1000
COUNT_INLINE_BELOW = 1000
CURSOR = re.compile(r"^(\d{1,12}(?:\.\d{1,20})?):(" + protocol.SESSION_ID_PATTERN[1:-1] + ")$")


class SessionPage(BaseModel):
    sessions: list[SessionOut]
    next: str | None = Field(
        None, description="pass as `cursor` for the next page; null on the last page"
    )
    counts: dict[str, int] = Field(
        default_factory=dict,
        description="sessions per state under the namespace/job filters (a few seconds old)",
    )


@dataclasses.dataclass(frozen=True)
class Scope:
    """What a listing selects, but for ``state`` (so counts cover every state)."""

    namespace: str | None
    job: str | None
    visible: tuple[str, ...] | None  # the viewer's namespaces; None: all

    @property
    def index(self) -> str:
        """The narrowest index holding every session in scope."""
        if self.job is not None:
            return keys.job_sessions(self.job)
        if self.namespace is not None:
            return keys.namespace_sessions(self.namespace)
        if self.visible is not None and len(self.visible) == 1:
            return keys.namespace_sessions(self.visible[0])
        return keys.SESSIONS

    def holds(self, s: SessionOut) -> bool:
        return _in_scope(self, s.namespace, s.job)


@router.get(protocol.SESSIONS, response_model=SessionPage)
async def list_sessions(
    who: Viewer,
    broker: BrokerDep,
    state: Annotated[str | None, Query(max_length=32)] = None,
    namespace: Annotated[str | None, Query(max_length=protocol.DNS_SUBDOMAIN_MAX)] = None,
    job: Annotated[str | None, Query(max_length=protocol.DNS_SUBDOMAIN_MAX)] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> SessionPage:
    """Sessions newest first, ``limit`` at most, filtered by ``namespace``, ``job`` and
    ``state`` (``lost`` included); follow ``next`` for more. A page may hold fewer
    than ``limit`` when the filters are narrow: only a null ``next`` means the end."""
    scope = Scope(namespace, job, _visible(who))
    position = _parse(cursor) if cursor else None
    sessions, after = await _page(broker, scope, state, position, limit)
    counts = await counts_for(broker, scope)
    return SessionPage(sessions=sessions, next=_format(after) if after else None, counts=counts)


def _visible(who: Principal) -> tuple[str, ...] | None:
    return None if who.namespaces is None else tuple(sorted(who.namespaces))


Position = tuple[float, str]  # (index score, session id) of the last entry read


async def _page(
    broker: Broker, scope: Scope, state: str | None, position: Position | None, limit: int
) -> tuple[list[SessionOut], Position | None]:
    """Up to ``limit`` matching sessions after ``position``, and where to go on (None: end)."""
    found: list[SessionOut] = []
    read = 0
    chunk = min(CHUNK, limit)  # a first page of 100 reads 100 hashes, not CHUNK
    while read < SCAN_BUDGET:
        entries = await _entries_after(broker, scope.index, position, chunk)
        if not entries:
            return found, None
        sessions = await read_many(broker, [i for i, _ in entries], scope.index)
        for (session_id, score), s in zip(entries, sessions, strict=True):
            read += 1
            position = (score, session_id)
            if s is not None and scope.holds(s) and state in (None, s.state):
                found.append(s)
                if len(found) == limit:
                    return found, position
        if len(entries) < chunk:
            return found, None
        chunk = CHUNK  # the filters dropped some: read on in full chunks
    return found, position


async def _entries_after(
    broker: Broker, index: str, position: Position | None, count: int
) -> list[tuple[str, float]]:
    """The next ``count`` (id, score) entries, newest first, strictly after ``position``.
    Equal scores come in reverse id order, so the ones at or above its id are skipped."""
    if position is None:
        return list(await broker.redis.zrevrangebyscore(index, "+inf", "-inf", 0, count, True))
    score, last = position
    skipped = 0
    while True:  # ties on one score are rare: widen the read until past them
        entries = await broker.redis.zrevrangebyscore(
            index, repr(score), "-inf", 0, count + skipped + 1, True
        )
        after = [(i, s) for i, s in entries if s < score or i < last]
        if len(after) >= count or len(entries) < count + skipped + 1:
            return after[:count]
        skipped = len(entries) - len(after)


def _parse(cursor: str) -> Position:
    match = CURSOR.match(cursor)
    if match is None:
        raise HTTPException(
            422, f"cursor={cursor!r} is not a cursor: pass the `next` of the previous page"
        )
    return float(match.group(1)), match.group(2)


def _format(position: Position) -> str:
    return f"{position[0]!r}:{position[1]}"  # repr: the exact score, read back as is


# -- counts ---------------------------------------------------------------------


@dataclasses.dataclass
class _Counted:
    counts: dict[str, int]
    at: float
    refreshing: asyncio.Task[None] | None = None


async def counts_for(broker: Broker, scope: Scope) -> dict[str, int]:
    """Sessions per state in ``scope``: counted now for a small scope, else the cached
    value, refreshed in the background once older than COUNTS_SECONDS."""
    cache = broker.caches.setdefault("session counts", {})
    cached = cache.get(scope)
    if cached is None or sum(cached.counts.values()) < COUNT_INLINE_BELOW:
        cached = cache[scope] = _Counted(await _count(broker, scope), time.monotonic())
    elif time.monotonic() - cached.at >= _max_age(cached) and cached.refreshing is None:
        cached.refreshing = asyncio.create_task(_refresh(broker, scope, cached))
    return cached.counts


def _max_age(cached: _Counted) -> float:
    return max(COUNTS_SECONDS, sum(cached.counts.values()) / COUNTS_PER_SECOND)


async def _refresh(broker: Broker, scope: Scope, cached: _Counted) -> None:
    try:
        cached.counts = await _count(broker, scope)
        cached.at = time.monotonic()
    finally:
        cached.refreshing = None


async def _count(broker: Broker, scope: Scope) -> dict[str, int]:
    """Reads only the fields the scope and the state need, COUNT_CHUNK sessions per trip."""
    counts: dict[str, int] = {}
    start = 0
    while True:
        ids = await broker.redis.zrange(scope.index, start, start + COUNT_CHUNK - 1)
        async with broker.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(keys.session(session_id), "state", "namespace", "job", "owner")
                pipe.exists(keys.alive(session_id))
            replies = await pipe.execute()
        for (state, namespace, job, owner), alive in zip(replies[::2], replies[1::2], strict=True):
            if owner is None or not _in_scope(scope, namespace, job):
                continue  # expired (pruned when listed), or another namespace's
            if not alive and state != protocol.FINAL_STATE:
                state = protocol.LOST
            state = state or protocol.INITIAL_STATE
            counts[state] = counts.get(state, 0) + 1
        if len(ids) < COUNT_CHUNK:
            return counts
        start += COUNT_CHUNK


def _in_scope(scope: Scope, namespace: str | None, job: str | None) -> bool:
    ns = namespace or ""
    return (
        (scope.visible is None or ns in scope.visible)
        and (scope.namespace is None or ns == scope.namespace)
        and (scope.job is None or job == scope.job)
    )
