"""What every request handler needs, built once in the app lifespan."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

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


def get_broker(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


BrokerDep = Annotated[Broker, Depends(get_broker)]


async def healthz() -> dict[str, str]:
    """The process is up (no token needed): the broker's and the webhook's."""
    return {"status": "ok"}
