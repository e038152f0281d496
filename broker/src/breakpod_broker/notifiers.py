"""Notifier sinks: webhooks (generic JSON or Slack format) for chosen event kinds.

Ingestion only appends one job per (notifier, event) to a Redis stream
(``keys.NOTIFY``); every replica reads it through one consumer group, so each
job goes to one replica, and ingestion never waits for a webhook. A failing
receiver is retried with exponential backoff; when it keeps failing the
failure is counted in /metrics and recorded in Redis (``GET /v1/notifiers``).
A job is removed once delivered or given up; one left behind by a replica
that stopped or crashed is claimed by another after ``notify_claim_seconds``.
Delivery is therefore at least once: a receiver may see a job twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any

import httpx
from redis.exceptions import RedisError, ResponseError

from breakpod_broker import keys
from breakpod_broker.metrics import Metrics
from breakpod_broker.models import SessionOut
from breakpod_broker.settings import Notifier

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 1000  # deliveries one replica runs at once; the rest wait in Redis
READ_BLOCK_MS = 2000
GROUP = "notifiers"


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
    """Queues matching events for the notifiers and delivers the queued jobs."""

    def __init__(
        self,
        notifiers: list[Notifier],
        redis: Any,
        metrics: Metrics,
        blocking: Any = None,
        claim_seconds: float = 300.0,
    ) -> None:
        self.notifiers = notifiers
        self.by_name = {n.name: n for n in notifiers}
        self.redis = redis
        self.blocking = blocking or redis
        self.metrics = metrics
        self.claim_seconds = claim_seconds
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.tasks: set[asyncio.Task[None]] = set()
        self.reader: asyncio.Task[None] | None = None
        self.client = httpx.AsyncClient(follow_redirects=False)

    async def start(self) -> None:
        """Join the consumer group and start reading jobs (no notifiers: nothing)."""
        if not self.notifiers:
            return
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
            await self.redis.xgroup_create(keys.NOTIFY, GROUP, id="0", mkstream=True)
        self.reader = asyncio.create_task(self._read_loop())

    async def enqueue(
        self, events: list[dict[str, Any]], sessions: Mapping[str, SessionOut]
    ) -> None:
        """One job per (notifier, matching event), in one round trip."""
        jobs = [
            {
                "notifier": n.name,
                "event": json.dumps(e, default=str),
                "session": _session_json(sessions, e),
            }
            for n in self.notifiers
            for e in events
            if e["kind"] in n.kinds
        ]
        if not jobs:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for job in jobs:
                    pipe.xadd(keys.NOTIFY, job, maxlen=keys.NOTIFY_MAXLEN, approximate=True)
                await pipe.execute()
        except RedisError as e:  # the events are stored: do not fail ingest
            for job in jobs:
                self.metrics.notifier_failures.labels(job["notifier"]).inc()
            log.warning("could not queue %d notifier jobs: %s", len(jobs), e)

    async def _read_loop(self) -> None:
        claimed_at = 0.0
        while True:
            try:
                if time.monotonic() - claimed_at >= min(self.claim_seconds, 30.0):
                    claimed_at = time.monotonic()
                    self._start_all(await self._claim())
                self._start_all(await self._read())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: keep the loop, try again shortly
                log.warning("notifier queue: %s: %s", type(e).__name__, e)
                await asyncio.sleep(1.0)

    async def _read(self) -> list[tuple[str, dict[str, str]]]:
        room = MAX_IN_FLIGHT - len(self.tasks)
        if room <= 0:
            await asyncio.sleep(0.1)
            return []
        reply = await self.blocking.xreadgroup(
            GROUP, self.consumer, {keys.NOTIFY: ">"}, count=min(room, 100), block=READ_BLOCK_MS
        )
        return list(reply[0][1]) if reply else []

    async def _claim(self) -> list[tuple[str, dict[str, str]]]:
        """Jobs another replica took but did not finish within claim_seconds."""
        idle_ms = int(self.claim_seconds * 1000)
        reply = await self.redis.xautoclaim(
            keys.NOTIFY, GROUP, self.consumer, idle_ms, start_id="0-0", count=100
        )
        return [e for e in reply[1] if e and e[1]]  # deleted entries come back empty

    def _start_all(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        for entry_id, fields in entries:
            task = asyncio.create_task(self._job(entry_id, fields))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _job(self, entry_id: str, fields: dict[str, str]) -> None:
        """Deliver one job, then remove it; cancelled (shutdown), it stays pending."""
        name = fields.get("notifier", "")
        try:
            if name not in self.by_name:
                log.warning("notifier %r is no longer configured: job dropped", name)
            else:
                event, session = json.loads(fields["event"]), _session(fields.get("session"))
                await self.deliver(self.by_name[name], event, session)
        except Exception:  # a job that cannot be read: dropped, not retried forever
            log.exception("notifier %r: job %s dropped", name, entry_id)
        with contextlib.suppress(Exception):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(keys.NOTIFY, GROUP, entry_id)
                pipe.xdel(keys.NOTIFY, entry_id)
                await pipe.execute()

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
        """Stop reading; give in-flight deliveries a moment, then cancel them (their
        jobs stay in Redis for another replica to claim)."""
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
        for task in list(self.tasks):
            task.cancel()
        await self.client.aclose()


def _session_json(sessions: Mapping[str, SessionOut], event: dict[str, Any]) -> str:
    session = sessions.get(event["session"])
    return session.model_dump_json() if session is not None else ""


def _session(raw: str | None) -> SessionOut | None:
    return SessionOut.model_validate_json(raw) if raw else None
