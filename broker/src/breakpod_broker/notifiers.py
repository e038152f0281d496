"""Notifier sinks: webhooks (generic JSON or Slack format) for chosen event kinds.

Delivery runs in background tasks of the replica that ingested the event, so
ingestion never waits for a webhook. A failing receiver is retried with
exponential backoff; when it keeps failing the failure is counted in
/metrics and recorded in Redis (``GET /v1/notifiers`` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from breakpod_broker import keys
from breakpod_broker.settings import Notifier

if TYPE_CHECKING:
    from breakpod_broker.metrics import Metrics
    from breakpod_broker.sessions import SessionOut

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 1000


def payload(
    notifier: Notifier, event: dict[str, Any], session: SessionOut | None
) -> dict[str, Any]:
    """The JSON body a notifier receives."""
    attach = f"breakpod attach {event['session']}"
    if notifier.format == "json":
        return {
            "event": event,
            "session": session.model_dump() if session else None,
            "attach": attach,
        }
    where = (session.pod or session.host or event["session"]) if session else event["session"]
    reason = event["fields"].get("reason") or event["fields"].get("message") or ""
    text = (
        f"*breakpod {event['kind']}* on `{where}`: {reason}".rstrip(": ") + f"\nattach: `{attach}`"
    )
    return {"text": text}


class Dispatcher:
    """Routes ingested events to the notifiers whose kinds match."""

    def __init__(self, notifiers: list[Notifier], redis: Any, metrics: Metrics) -> None:
        self.notifiers = notifiers
        self.redis = redis
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()
        self.client = httpx.AsyncClient(follow_redirects=False)

    def dispatch(self, events: list[dict[str, Any]], sessions: Mapping[str, SessionOut]) -> None:
        for notifier in self.notifiers:
            for event in events:
                if event["kind"] in notifier.kinds:
                    self._spawn(notifier, event, sessions.get(event["session"]))

    def _spawn(self, notifier: Notifier, event: dict[str, Any], session: SessionOut | None) -> None:
        if len(self.tasks) >= MAX_IN_FLIGHT:
            self.metrics.notifier_failures.labels(notifier.name).inc()
            log.warning(
                "notifier %s: %d deliveries in flight; dropping one", notifier.name, MAX_IN_FLIGHT
            )
            return
        task = asyncio.create_task(self.deliver(notifier, event, session))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def deliver(
        self, notifier: Notifier, event: dict[str, Any], session: SessionOut | None
    ) -> None:
        body = payload(notifier, event, session)
        error = ""
        for attempt in range(notifier.retries + 1):
            if attempt:
                await asyncio.sleep(notifier.backoff_seconds * 2 ** (attempt - 1))
            error = await self._post(notifier, body)
            if not error:
                self.metrics.notifier_deliveries.labels(notifier.name).inc()
                return
        await self._failed(notifier, event, error, notifier.retries + 1)

    async def _post(self, notifier: Notifier, body: dict[str, Any]) -> str:
        """'' on success, else why it failed."""
        try:
            response = await self.client.post(
                str(notifier.url), json=body, timeout=notifier.timeout_seconds
            )
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        return "" if response.is_success else f"HTTP {response.status_code}"

    async def _failed(
        self, notifier: Notifier, event: dict[str, Any], error: str, attempts: int
    ) -> None:
        self.metrics.notifier_failures.labels(notifier.name).inc()
        log.warning(
            "notifier %s gave up on event %s after %d attempts: %s",
            notifier.name,
            event["id"],
            attempts,
            error,
        )
        record = {
            "notifier": notifier.name,
            "event": event["id"],
            "session": event["session"],
            "namespace": event.get("namespace") or "",  # GET /v1/notifiers filters on it
            "error": error,
        }
        with contextlib.suppress(Exception):  # a lost record must not kill the task
            await self.redis.xadd(
                keys.NOTIFIER_FAILURES,
                {**record, "attempts": str(attempts), "time": str(time.time())},
                maxlen=keys.NOTIFIER_FAILURES_MAXLEN,
                approximate=True,
            )

    async def close(self, timeout: float = 2.0) -> None:
        """Give in-flight deliveries a moment, then cancel them."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        for task in list(self.tasks):
            task.cancel()
        await self.client.aclose()
