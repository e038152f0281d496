"""Fixtures for the chaos suite: the real-Redis and broker-process fixtures of
tests/broker, shared here. ``CHAOS_ROUNDS`` (default 2; ``make chaos``: 20)
sets how many times each fault is injected."""

from tests.brokerkit import _shared_broker, broker, redis_server, redis_url, start_broker  # noqa: F401
