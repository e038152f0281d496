"""Redis Cluster: the writes that span several hash slots, done one slot at a time.

With one Redis, registering a session and ingesting its events are each one Lua
call (scripts.py) that also touches the global structures (keys.SESSIONS and
the listing indexes, keys.EVENTS). A Redis Cluster runs a script on one slot
only, so there the broker splits them, each step idempotent and ordered so that
a broker that dies between two steps leaves nothing a retry cannot mend:

* register: the session's own keys in one script, then ZADD into each index
  with the score the script returns (a re-registration adds the same score);
* prune (a listed session whose hash expired): ZREM from the index, then look
  again and put back a session re-registered meanwhile (its registration wrote
  the hash before its ZADD, so one of the two sees the other);
* ingest: the ids not yet seen are appended to the global stream (XADD ``*``),
  then the session's script stores them under the same cursors, marks them seen
  and applies state changes; an event another request stored meanwhile is
  deleted again from the global stream. A broker dying between the two leaves
  the event in the global stream only; the agent's retry stores it again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from breakpod_broker import keys


async def add_to_indexes(redis: Any, session_id: str, created: float, indexes: list[str]) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for index in indexes:
            pipe.zadd(index, {session_id: created})
        await pipe.execute()


async def prune(redis: Any, gone: list[str], index: str) -> None:
    """Drop ``gone`` from ``index`` unless a session came back meanwhile."""
    async with redis.pipeline(transaction=False) as pipe:
        for session_id in gone:
            pipe.zrem(index, session_id)
        await pipe.execute()
    async with redis.pipeline(transaction=False) as pipe:
        for session_id in gone:
            pipe.hget(keys.session(session_id), "created")
        created = await pipe.execute()
    back = {i: float(c) for i, c in zip(gone, created, strict=True) if c is not None}
    if back:
        await redis.zadd(index, back)


async def ingest(
    broker: Any, by_session: dict[str, list[int]], events: list[Any], encoded: list[str], args: Any
) -> list[str]:
    """The cluster form of the one-Redis INGEST_LUA: one reply per session, as it."""
    s = broker.settings
    redis = broker.redis
    async with redis.pipeline(transaction=False) as pipe:
        for event in events:
            pipe.exists(keys.seen(event.session, event.id))
        seen = await pipe.execute()
    new = [i for i, already in enumerate(seen) if not already]
    cursors: dict[int, str] = {}
    if new:
        async with redis.pipeline(transaction=False) as pipe:
            for i in new:
                pipe.xadd(
                    keys.EVENTS,
                    {"event": encoded[i]},
                    maxlen=s.global_stream_maxlen,
                    approximate=True,
                )
            cursors = dict(zip(new, await pipe.execute(), strict=True))

    async def one(session_id: str, indexes: list[int]) -> str:
        fresh = [i for i in indexes if i in cursors]
        if not fresh:
            return ",".join("" for _ in indexes)
        reply = await broker.scripts.ingest_session(
            keys=[keys.session_events(session_id), keys.session(session_id)],
            args=args(session_id, fresh, cursors),
        )
        stored = dict(zip(fresh, str(reply).split(","), strict=True))
        return ",".join(stored.get(i, "") for i in indexes)

    replies = await asyncio.gather(*(one(sid, ix) for sid, ix in by_session.items()))
    stored = {c for reply in replies for c in reply.split(",") if c}
    duplicates = [c for c in cursors.values() if c not in stored]
    if duplicates:  # another request stored these first
        await redis.xdel(keys.EVENTS, *duplicates)
    return list(replies)
