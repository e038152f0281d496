"""What every request handler needs, built once in the app lifespan."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fastapi import Request

from breakpod_broker.settings import BrokerSettings

if TYPE_CHECKING:
    from breakpod_broker.auth import TokenStore
    from breakpod_broker.metrics import Metrics
    from breakpod_broker.notifiers import Dispatcher


@dataclasses.dataclass
class Broker:
    settings: BrokerSettings
    # redis.asyncio.Redis with decode_responses=True: replies are str, which
    # redis-py's annotations (bytes | str | None everywhere) cannot express
    redis: Any
    tokens: TokenStore
    metrics: Metrics
    notifiers: Dispatcher


def get_broker(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker
