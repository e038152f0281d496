"""How often agents beat, and how long a silent session stays alive, by the session count.

A broker with few sessions asks for the agent's usual beat every BASE_SECONDS.
With more, the interval grows so that all sessions together make about
``heartbeat_rate`` beats per second (10,000 sessions at 200/s: one beat per 50 s
each), up to MAX_SECONDS. The broker tells each agent in its registration's and
heartbeat's answer (``heartbeat_seconds``); agents beat a little earlier than
asked, at a random fraction of it, so beats do not come in waves.

Liveness scales with it: a session is lost after the same number of missed
beats at any size. Its alive key lives ``heartbeat_ttl_seconds`` x interval /
BASE_SECONDS (60 s at 15 s; 200 s at 50 s). The count is one ZCARD of the
session index per replica every COUNT_SECONDS, read in the background (a
request never waits on it), so replicas agree within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from redis.exceptions import RedisError

from breakpod_broker import keys
from breakpod_broker.settings import BrokerSettings

log = logging.getLogger(__name__)
BASE_SECONDS = 15.0  # the agent's interval with few sessions (emitter.HEARTBEAT_SECONDS)
MAX_SECONDS = 300.0
COUNT_SECONDS = 5.0


class Liveness:
    def __init__(self, settings: BrokerSettings, redis: Any) -> None:
        self.settings = settings
        self.redis = redis
        self.sessions = 0  # sessions in the index, as last counted
        self._counted_at = -math.inf
        self._counting: asyncio.Task[None] | None = None

    def interval(self) -> float:
        """Seconds between an agent's beats, for the session count now."""
        self._count_soon()
        wanted = self.sessions / self.settings.heartbeat_rate
        return round(min(MAX_SECONDS, max(BASE_SECONDS, wanted)), 1)

    def ttl(self) -> int:
        """Seconds a session stays alive without a beat: the same missed beats at any size."""
        scale = self.interval() / BASE_SECONDS
        return math.ceil(self.settings.heartbeat_ttl_seconds * scale)

    async def count(self) -> None:
        """Count now (at start-up; then in the background)."""
        try:
            self.sessions = int(await self.redis.zcard(keys.SESSIONS))
        except RedisError as e:  # keep the last count; try again later
            log.debug("liveness: cannot count sessions (%s)", e)
        finally:
            self._counted_at = time.monotonic()

    async def close(self) -> None:
        if self._counting is not None:
            self._counting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._counting

    def _count_soon(self) -> None:
        stale = time.monotonic() - self._counted_at >= COUNT_SECONDS
        if stale and self._counting is None:
            self._counting = asyncio.create_task(self._count_once())

    async def _count_once(self) -> None:
        try:
            await self.count()
        finally:
            self._counting = None
