"""What every request handler needs, built once in the app lifespan."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from breakpod_broker.fanout import EventFanout
from breakpod_broker.liveness import BASE_SECONDS, Liveness
from breakpod_broker.metrics import Metrics
from breakpod_broker.notifiers import Dispatcher
from breakpod_broker.redis_server import EmbeddedRedis
from breakpod_broker.scripts import Scripts
from breakpod_broker.settings import BrokerSettings
from breakpod_broker.tokens import TokenStore


@dataclasses.dataclass
class Broker:
    settings: BrokerSettings
    # redis.asyncio.Redis with decode_responses=True: replies are str, which
    # redis-py's annotations (bytes | str | None everywhere) cannot express
    redis: Any
    tokens: TokenStore
    metrics: Metrics
    notifiers: Dispatcher
    scripts: Scripts  # registered with ``redis``
    # a second client for BLMOVE/XREAD BLOCK: a socket timeout longer than any
    # block, and its own bounded pool, so waiters never starve ordinary requests
    blocking: Any = None
    waiters: int = 0
    embedded: EmbeddedRedis | None = None  # the supervised redis-server, without a Redis URL
    fanout: EventFanout | None = None  # the replica's one reader of the event stream
    wakeups: Any = None  # wakeups.CommandWakeups: the replica's one command subscription
    # per-replica caches of values recomputed every few seconds, by what they hold
    caches: dict[str, dict[Any, Any]] = dataclasses.field(default_factory=dict)
    cluster: bool = False  # Redis Cluster: multi-slot writes go through sharded.py
    liveness: Liveness | None = None  # the heartbeat interval and alive TTL for the session count

    def alive_ttl(self) -> int:
        """Seconds a session stays alive after a beat (or a poll): liveness.py."""
        if self.liveness is None:
            return self.settings.heartbeat_ttl_seconds
        return self.liveness.ttl()

    def heartbeat_seconds(self) -> float:
        """The interval agents are asked to beat at: liveness.py."""
        return BASE_SECONDS if self.liveness is None else self.liveness.interval()

    def room_to_follow(self) -> None:
        """429 when the replica already serves ``max_followers`` event streams."""
        limit = self.settings.max_followers
        if self.fanout is not None and self.fanout.followers >= limit:
            raise HTTPException(
                429,
                f"this broker replica already serves {limit} event streams: "
                "retry later (or raise BREAKPOD_MAX_FOLLOWERS)",
                {"Retry-After": "5"},
            )

    def room(self, what: str) -> None:
        """429 when the replica already serves ``max_waiters`` long polls and streams."""
        limit = self.settings.max_waiters
        if self.waiters >= limit:
            raise HTTPException(
                429,
                f"this broker replica already serves {limit} long polls and streams: "
                f"retry the {what} later (or raise BREAKPOD_MAX_WAITERS)",
                {"Retry-After": "5"},
            )

    @contextlib.contextmanager
    def waiting(self, what: str, check: bool = True) -> Iterator[None]:
        """Hold one of the replica's ``max_waiters`` slots (429 when none is free)."""
        if check:
            self.room(what)
        self.waiters += 1
        try:
            yield
        finally:
            self.waiters -= 1


async def get_broker(request: Request) -> Broker:
    """async, so FastAPI calls it on the loop: a plain ``def`` dependency costs every
    request a hop to the thread pool (9% of a heartbeat's time, profiled)."""
    broker: Broker = request.app.state.broker
    return broker


BrokerDep = Annotated[Broker, Depends(get_broker)]


async def healthz() -> dict[str, str]:
    """The process is up (no token needed): the broker's and the webhook's."""
    return {"status": "ok"}
