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
``COUNTS_PER_SECOND`` sessions in scope when more (a page never waits on it).
With one Redis the count runs in Redis (scripts.COUNT_LUA, 500 sessions per
call), so the broker parses one short reply per chunk instead of two per
session. Replicas share each scope's counts through Redis (keys.counts): one
replica recounts a scope at a time, the others take its result, and a replica's
first page of a large scope takes the shared counts instead of counting inline.
So a first page costs a range read of the index and the page's hashes: O(page).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
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
COUNT_LOCK = 30  # seconds one replica may take to count a scope before another may
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
    at: float  # wall clock: replicas share counts through Redis
    refreshing: asyncio.Task[None] | None = None


async def counts_for(broker: Broker, scope: Scope) -> dict[str, int]:
    """Sessions per state in ``scope``: counted now for a small scope, else the cached
    value, refreshed in the background once older than ``_max_age``. A replica
    that has none yet takes the one another replica shared in Redis."""
    cache = broker.caches.setdefault("session counts", {})
    cached = cache.get(scope)
    if cached is None:
        cached = await _shared(broker, scope)
        if cached is None or sum(cached.counts.values()) < COUNT_INLINE_BELOW:
            cached = _Counted(await _count(broker, scope), time.time())
            await _share(broker, scope, cached)
        cache[scope] = cached
    elif sum(cached.counts.values()) < COUNT_INLINE_BELOW:
        cached.counts, cached.at = await _count(broker, scope), time.time()
    elif time.time() - cached.at >= _max_age(cached) and cached.refreshing is None:
        cached.refreshing = asyncio.create_task(_refresh(broker, scope, cached))
    return cached.counts


def _max_age(cached: _Counted) -> float:
    return max(COUNTS_SECONDS, sum(cached.counts.values()) / COUNTS_PER_SECOND)


async def _refresh(broker: Broker, scope: Scope, cached: _Counted) -> None:
    """Take a fresh count another replica shared, else count (one replica at a time
    per scope: the others keep theirs until the new one is shared)."""
    try:
        shared = await _shared(broker, scope)
        if shared is not None and time.time() - shared.at < _max_age(shared):
            cached.counts, cached.at = shared.counts, shared.at
        elif await broker.redis.set(_shared_key(scope, "counting"), "1", nx=True, ex=COUNT_LOCK):
            cached.counts, cached.at = await _count(broker, scope), time.time()
            await _share(broker, scope, cached)
    finally:
        cached.refreshing = None


def _shared_key(scope: Scope, what: str) -> str:
    """keys.counts: the scope's shared counts (or the lock of the replica counting them)."""
    visible = "*" if scope.visible is None else ",".join(scope.visible)
    name = json.dumps([scope.namespace, scope.job, visible])
    return keys.counts(hashlib.sha256(name.encode()).hexdigest()[:32], what)


async def _shared(broker: Broker, scope: Scope) -> _Counted | None:
    raw = await broker.redis.get(_shared_key(scope, "counts"))
    if raw is None:
        return None
    doc = json.loads(raw)
    return _Counted({str(k): int(v) for k, v in doc["counts"].items()}, float(doc["at"]))


async def _share(broker: Broker, scope: Scope, cached: _Counted) -> None:
    doc = json.dumps({"counts": cached.counts, "at": cached.at})
    ttl = int(_max_age(cached) * 3) + 10  # a count nobody refreshes goes away
    await broker.redis.set(_shared_key(scope, "counts"), doc, ex=ttl)


async def _count(broker: Broker, scope: Scope) -> dict[str, int]:
    """COUNT_CHUNK sessions per round trip; with one Redis, counted there (scripts.COUNT_LUA)."""
    counts: dict[str, int] = {}
    start = 0
    while True:
        ids = await broker.redis.zrange(scope.index, start, start + COUNT_CHUNK - 1)
        chunk = await (_count_in_redis if not broker.cluster else _count_here)(broker, scope, ids)
        for state, n in chunk.items():
            counts[state] = counts.get(state, 0) + n
        if len(ids) < COUNT_CHUNK:
            return counts
        start += COUNT_CHUNK


async def _count_in_redis(broker: Broker, scope: Scope, ids: list[str]) -> dict[str, int]:
    if not ids:
        return {}
    reply = await broker.scripts.count(
        keys=[*map(keys.session, ids), *map(keys.alive, ids)],
        args=[
            *(len(ids), ",".join(protocol.FINAL_STATES), protocol.LOST, protocol.INITIAL_STATE),
            "" if scope.namespace is None else f"={scope.namespace}",
            "" if scope.job is None else f"={scope.job}",
            *(("*",) if scope.visible is None else scope.visible),
        ],
    )
    return {str(state): int(n) for state, n in zip(reply[::2], reply[1::2], strict=True)}


async def _count_here(broker: Broker, scope: Scope, ids: list[str]) -> dict[str, int]:
    """A Redis Cluster: the sessions' keys span slots, so they are read and counted here."""
    counts: dict[str, int] = {}
    async with broker.redis.pipeline(transaction=False) as pipe:
        for session_id in ids:
            pipe.hmget(keys.session(session_id), "state", "namespace", "job", "owner")
            pipe.exists(keys.alive(session_id))
        replies = await pipe.execute()
    for (state, namespace, job, owner), alive in zip(replies[::2], replies[1::2], strict=True):
        if owner is None or not _in_scope(scope, namespace, job):
            continue  # expired (pruned when listed), or another namespace's
        if not alive and state not in protocol.FINAL_STATES:
            state = protocol.LOST
        state = state or protocol.INITIAL_STATE
        counts[state] = counts.get(state, 0) + 1
    return counts


def _in_scope(scope: Scope, namespace: str | None, job: str | None) -> bool:
    ns = namespace or ""
    return (
        (scope.visible is None or ns in scope.visible)
        and (scope.namespace is None or ns == scope.namespace)
        and (scope.job is None or job == scope.job)
    )
