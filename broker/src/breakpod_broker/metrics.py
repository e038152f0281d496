"""Prometheus metrics of one broker process (scrape every replica).

Counters are per process; ``breakpod_sessions`` is read from Redis at scrape
time (at most every settings.metrics_cache_seconds), so every replica reports the same,
cluster-wide numbers.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from breakpod import protocol

Counting = Callable[[], Awaitable[dict[str, int]]]
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """One registry per app, so several apps in one process never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "breakpod_events_ingested", "Events stored, by kind", ["kind"], registry=r
        )
        self.duplicates = Counter(
            "breakpod_events_duplicate", "Retried events dropped as duplicates", registry=r
        )
        self.notifier_deliveries = Counter(
            "breakpod_notifier_deliveries", "Webhook deliveries", ["notifier"], registry=r
        )
        self.notifier_failures = Counter(
            "breakpod_notifier_failures",
            "Webhook jobs given up (dead letters, listed by the notifiers endpoint)",
            ["notifier"],
            registry=r,
        )
        self.notifier_retries = Counter(
            "breakpod_notifier_retries",
            "Webhook attempts that failed (the job is retried until notify_max_age)",
            ["notifier"],
            registry=r,
        )
        self.sessions = Gauge(
            "breakpod_sessions", "Known sessions by state (from Redis)", ["state"], registry=r
        )
        self.redis_latency = Histogram(
            "breakpod_redis_latency_seconds",
            "Redis round trips",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._counts: dict[str, int] = {}
        self._counted_at = -float("inf")

    def ingested(self, docs: list[dict[str, Any]], duplicates: int) -> None:
        for kind, count in collections.Counter(d["kind"] for d in docs).items():
            self.events.labels(kind).inc(count)
        if duplicates:
            self.duplicates.inc(duplicates)

    async def ping(self, redis: Any) -> float:
        started = time.perf_counter()
        await redis.ping()
        elapsed = time.perf_counter() - started
        self.redis_latency.labels("ping").observe(elapsed)
        return elapsed

    async def session_counts(self, count: Counting, every: float) -> dict[str, int]:
        """``count()`` at most every ``every`` seconds: it reads every session from Redis."""
        if time.monotonic() - self._counted_at >= every:
            self._counts, self._counted_at = await count(), time.monotonic()
        return self._counts

    def render(self, sessions_by_state: dict[str, int]) -> bytes:
        for state in (*protocol.STATES, protocol.LOST):
            self.sessions.labels(state).set(sessions_by_state.get(state, 0))
        return generate_latest(self.registry)
