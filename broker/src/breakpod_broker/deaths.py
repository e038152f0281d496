"""Deaths pushed: a ``lost`` event the moment a session's heartbeats stop.

A session is alive while its alive key lives (keys.alive; liveness.py sets how
long). Every beat, command poll and registration also writes the moment that
key will expire into one sorted set (keys.DEADLINES). Each replica sweeps it
every SWEEP_SECONDS: an entry past its deadline is claimed with a script that
removes it only if its score is still the one read (a beat in between moved it
on: nothing to claim), so exactly one replica claims each death, however many
sweep. The claimant checks the alive key itself (Redis's clock decides, not the
replica's): still there, the entry goes back with the key's remaining time;
gone, and the session not ended, it records a ``lost`` event for it through
the ordinary ingest (streams, the dashboard's SSE, notifiers). The event's id is
the session's deadline, so even a claim repeated after a crash stores one event.

So a death is pushed within SWEEP_SECONDS of the alive key's expiry (the heartbeat
TTL), with or without readers, and with any number of replicas. A session that
beats again is alive again (it was ``lost``, never ended); its next silence is
another death. Why it died, where the runtime can tell, comes from the engine
and pod watches (docker_watch.py, pod_watch.py) as a ``killed`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.exceptions import RedisError

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.context import Broker
from breakpod_broker.events import ingest
from breakpod_broker.models import EventIn
from breakpod_broker.scripts import pipelined
from breakpod_broker.sessions import read_many

log = logging.getLogger(__name__)
SWEEP_SECONDS = 1.0
BATCH = 500  # deadlines claimed per sweep (more wait for the next, a second later)
ERROR_LOG_SECONDS = 60.0

# KEYS: the deadlines. ARGV: a session id, its score as read. Removes the entry
# only if its score is unchanged: 1 for the one caller that claimed it, else 0.
CLAIM_LUA = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class Deaths:
    """The replica's sweeper (started and closed with the app)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.claim = broker.redis.register_script(CLAIM_LUA)
        self.task: asyncio.Task[None] | None = None
        self.recorded = 0  # lost events this replica recorded
        self._said_at = -ERROR_LOG_SECONDS

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except RedisError as e:  # Redis away: sweep again later, say so now and then
                if time.monotonic() - self._said_at >= ERROR_LOG_SECONDS:
                    self._said_at = time.monotonic()
                    log.warning("deaths: cannot sweep the session deadlines (%s)", e)
            await asyncio.sleep(SWEEP_SECONDS)

    async def sweep(self) -> int:
        """Claim the deadlines that passed and record the deaths; how many were recorded."""
        redis = self.broker.redis
        due = await redis.zrangebyscore(
            keys.DEADLINES, "-inf", time.time(), start=0, num=BATCH, withscores=True
        )
        if not due:
            return 0
        calls = [([keys.DEADLINES], [sid, repr(float(score))]) for sid, score in due]
        won = await pipelined(redis, self.claim, calls)
        claimed = [(sid, float(score)) for (sid, score), ok in zip(due, won, strict=True) if ok]
        dead = await self._still_dead(claimed)
        for session_id, deadline, was in dead:
            await self._record(session_id, deadline, was)
        return len(dead)

    async def _still_dead(self, claimed: list[tuple[str, float]]) -> list[tuple[str, float, str]]:
        """The claimed sessions whose alive key is gone: (id, deadline, state before).
        One whose key still lives (a replica's clock ahead of Redis's) goes back."""
        async with self.broker.redis.pipeline(transaction=False) as pipe:
            for session_id, _ in claimed:
                pipe.pttl(keys.alive(session_id))
                pipe.hget(keys.session(session_id), "state")
            replies = await pipe.execute()
        dead, back = [], {}
        for (session_id, deadline), ttl, state in zip(
            claimed, replies[::2], replies[1::2], strict=True
        ):
            if ttl > 0:
                back[session_id] = time.time() + ttl / 1000
            elif state is not None and state not in protocol.FINAL_STATES:
                dead.append((session_id, deadline, state))
        if back:
            await self.broker.redis.zadd(keys.DEADLINES, back, gt=True)
        return dead

    async def _record(self, session_id: str, deadline: float, was: str) -> None:
        session = (await read_many(self.broker, [session_id]))[0]
        if session is None or session.state != protocol.LOST:
            return  # expired meanwhile, or alive again
        silent = max(0.0, deadline - session.last_seen)
        fields: dict[str, Any] = {
            "reason": f"{protocol.LOST_REASON} for {silent:.0f}s (was {was})",
            "was": was,
            "last_seen": session.last_seen,
        }
        event = EventIn(
            id=f"lost-{int(deadline * 1000)}",
            session=session_id,
            kind=protocol.LOST_KIND,
            time=deadline,
            fields=fields,
        )
        reply = await ingest(self.broker, [event], {session_id: session})
        self.recorded += reply.accepted
        if reply.accepted:
            log.info("session %s lost: %s", session_id, fields["reason"])
