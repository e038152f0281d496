"""Notifier sinks: webhooks (generic JSON or Slack format) for chosen event kinds.

Ingestion only appends one job per (notifier, event) to a Redis stream
(``keys.NOTIFY``); every replica reads it through one consumer group, so each
job goes to one replica, and ingestion never waits for a webhook.

Delivery policy: a job stays in Redis until it is delivered or dead-lettered.
A failing receiver is retried with exponential backoff (``backoff_seconds``
doubling up to ``max_backoff_seconds``) until the job is ``notify_max_age``
old (default 1 h; or after ``retries`` attempts when a notifier sets them),
then it becomes a dead letter: counted in /metrics and listed by
``GET /v1/notifiers``.

Exactly once from a healthy broker: the replica delivering a job keeps it
fresh in the consumer group while it retries, and claims only jobs that
another consumer left idle for ``notify_claim_seconds`` (one that stopped or
crashed), never its own. Each body and request carries an idempotency key
(notifier, session, event); a delivered key is remembered in Redis, so a job
whose acknowledgement was lost is not delivered again. A receiver that must
never see a duplicate even across a crash mid-request dedupes on the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.metrics import Metrics
from breakpod_broker.models import SessionOut
from breakpod_broker.settings import Notifier

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 1000  # deliveries one replica runs at once; the rest wait in Redis
READ_BLOCK_MS = 2000
GROUP = "notifiers"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def idempotency_key(notifier: str, event: dict[str, Any]) -> str:
    return f"{notifier}:{event['session']}:{event['id']}"


def facts(event: dict[str, Any], session: SessionOut | None) -> dict[str, Any]:
    """What every format says: rule, module, step, summary, state, address, attach."""
    fields = event.get("fields") or {}
    state, said = _moved_to(event["kind"], fields)
    state = state or (session.state if session else None)
    address = fields.get("address") if event["kind"] in protocol.LISTENER_KINDS else None
    if session is not None:
        address = address or session.attach_address or session.address
    summary = fields.get("summary") or fields.get("reason") or fields.get("message") or said
    return {
        "rule": fields.get("rule"),
        "module": fields.get("module"),
        "step": fields.get("step"),
        "summary": str(summary),
        "state": state,
        "address": address if isinstance(address, str) else None,
        "attach": f"breakpod attach {event['session']}",
    }


def _moved_to(kind: str, fields: dict[str, Any]) -> tuple[str | None, str]:
    """The state an event moved its session to and why, in the broker's words: a
    finished event's exit says finished, failed or killed; a lost one, lost."""
    if kind == protocol.LOST_KIND:
        return protocol.LOST, protocol.LOST_REASON
    ended = protocol.final_state(kind, fields)
    if ended is not None:
        return ended[0], ended[1]
    return protocol.STATE_OF_KIND.get(kind), ""


def payload(
    notifier: Notifier, event: dict[str, Any], session: SessionOut | None
) -> dict[str, Any]:
    """The JSON body a notifier receives."""
    told = facts(event, session)
    key = idempotency_key(notifier.name, event)
    if notifier.format == "json":
        if session is not None:  # the state the event moved it to, not the one before
            changed = {"state": told["state"], "address": told["address"] or session.address}
            session = session.model_copy(update=changed)
        dumped = session.model_dump() if session else None
        return {"id": key, **told, "event": event, "session": dumped}
    return {"text": _slack_text(event, session, told)}


def _slack_text(event: dict[str, Any], session: SessionOut | None, told: dict[str, Any]) -> str:
    where = (session.pod or session.host or event["session"]) if session else event["session"]
    head = f"*breakpod {event['kind']}* on `{where}`: {told['summary']}".rstrip(": ")
    details = [
        f"{name}: `{told[name]}`"
        for name in ("rule", "module", "step", "state", "address")
        if told[name] not in (None, "")
    ]
    lines = [head, " · ".join(details), f"attach: `{told['attach']}`"]
    return "\n".join(line for line in lines if line)


class Dispatcher:
    """Queues matching events for the notifiers and delivers the queued jobs."""

    def __init__(
        self,
        notifiers: list[Notifier],
        redis: Any,
        metrics: Metrics,
        blocking: Any = None,
        claim_seconds: float = 300.0,
        max_age: float = 3600.0,
    ) -> None:
        self.notifiers = notifiers
        self.by_name = {n.name: n for n in notifiers}
        self.redis = redis
        self.blocking = blocking or redis
        self.metrics = metrics
        self.claim_seconds = claim_seconds
        self.max_age = max_age
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.running: dict[str, asyncio.Task[None]] = {}  # entry id -> its delivery
        self.reader: asyncio.Task[None] | None = None
        self.client = httpx.AsyncClient(follow_redirects=False)
        self._claim_from = "0-0"

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
        """One job per (notifier, matching event), in one round trip; none for a
        stale event (see :func:`current`)."""
        events = current(events, sessions)
        jobs = [
            {
                "notifier": n.name,
                "event": json.dumps(e, default=str),
                "session": _session_json(sessions, e),
            }
            for n in self.notifiers
            for e in events
            if protocol.notified_as(e["kind"], e.get("fields") or {}) & set(n.kinds)
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

    def policy(self, notifier: Notifier) -> str:
        """The delivery policy in words (GET /v1/notifiers)."""
        limit = f", at most {notifier.retries} retries" if notifier.retries is not None else ""
        return (
            f"retried with backoff from {notifier.backoff_seconds:g} s doubling to "
            f"{notifier.max_backoff_seconds:g} s for up to {self.max_age:g} s{limit}, "
            "then a dead letter"
        )

    @property
    def _period(self) -> float:
        """How often in-flight jobs are kept fresh and abandoned ones looked for:
        well inside claim_seconds, so no other replica ever takes a live job."""
        return min(self.claim_seconds / 4, 30.0)

    async def _read_loop(self) -> None:
        maintained = 0.0
        while True:
            try:
                if time.monotonic() - maintained >= self._period:
                    maintained = time.monotonic()
                    await self._keep_fresh()
                    self._start_all(await self._claim())
                self._start_all(await self._read())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: keep the loop, try again shortly
                log.warning("notifier queue: %s: %s", type(e).__name__, e)
                await asyncio.sleep(min(1.0, self._period))

    async def _read(self) -> list[tuple[str, dict[str, str]]]:
        room = MAX_IN_FLIGHT - len(self.running)
        if room <= 0:
            await asyncio.sleep(0.1)
            return []
        block = max(1, min(READ_BLOCK_MS, int(self._period * 1000)))
        reply = await self.blocking.xreadgroup(
            GROUP, self.consumer, {keys.NOTIFY: ">"}, count=min(room, 100), block=block
        )
        return list(reply[0][1]) if reply else []

    async def _keep_fresh(self) -> None:
        """Reset the idle time of the jobs this replica is delivering (XCLAIM to
        itself, JUSTID: the delivery count stays), so none looks abandoned."""
        if self.running:
            await self.redis.xclaim(
                keys.NOTIFY, GROUP, self.consumer, 0, list(self.running), justid=True
            )

    async def _claim(self) -> list[tuple[str, dict[str, str]]]:
        """Jobs left idle for claim_seconds by a consumer that stopped or crashed;
        never one this replica is delivering itself."""
        idle_ms = int(self.claim_seconds * 1000)
        reply = await self.redis.xautoclaim(
            keys.NOTIFY, GROUP, self.consumer, idle_ms, start_id=self._claim_from, count=100
        )
        self._claim_from = reply[0] or "0-0"
        return [e for e in reply[1] if e and e[1] and e[0] not in self.running]

    def _start_all(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        for entry_id, fields in entries:
            if entry_id in self.running:
                continue
            task = asyncio.create_task(self._job(entry_id, fields))
            self.running[entry_id] = task
            task.add_done_callback(functools.partial(self._done, entry_id))

    def _done(self, entry_id: str, _: asyncio.Task[None]) -> None:
        self.running.pop(entry_id, None)

    async def _job(self, entry_id: str, fields: dict[str, str]) -> None:
        """Deliver one job, then remove it; cancelled (shutdown), it stays pending."""
        name = fields.get("notifier", "")
        try:
            if name not in self.by_name:
                log.warning("notifier %r is no longer configured: job dropped", name)
            else:
                event, session = json.loads(fields["event"]), _session(fields.get("session"))
                await self.deliver(self.by_name[name], event, session, _enqueued(entry_id))
        except asyncio.CancelledError:
            raise
        except Exception:  # a job that cannot be read: dropped, not retried forever
            log.exception("notifier %r: job %s dropped", name, entry_id)
        with contextlib.suppress(Exception):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(keys.NOTIFY, GROUP, entry_id)
                pipe.xdel(keys.NOTIFY, entry_id)
                await pipe.execute()

    async def deliver(
        self,
        notifier: Notifier,
        event: dict[str, Any],
        session: SessionOut | None,
        enqueued: float | None = None,
    ) -> None:
        """POST until delivered, then remember the key; past the policy: dead letter."""
        key = idempotency_key(notifier.name, event)
        if await self._delivered_before(key):
            return
        body, enqueued = payload(notifier, event, session), enqueued or time.time()
        attempt, error = 0, ""
        while True:
            error = await self._post(notifier, body, key)
            attempt += 1
            if not error:
                self.metrics.notifier_deliveries.labels(notifier.name).inc()
                await self._remember(key)
                return
            self.metrics.notifier_retries.labels(notifier.name).inc()
            pause = min(notifier.backoff_seconds * 2 ** (attempt - 1), notifier.max_backoff_seconds)
            out_of_time = time.time() + pause - enqueued > self.max_age
            if out_of_time or (notifier.retries is not None and attempt > notifier.retries):
                break
            await asyncio.sleep(pause)
        await self._failed(notifier, event, error, attempt, time.time() - enqueued)

    async def _delivered_before(self, key: str) -> bool:
        try:
            return bool(await self.redis.exists(keys.notified(key)))
        except RedisError:  # cannot tell: deliver (at least once beats never)
            return False

    async def _remember(self, key: str) -> None:
        with contextlib.suppress(RedisError):
            await self.redis.set(keys.notified(key), "1", ex=int(self.max_age) + 1)

    async def _post(self, notifier: Notifier, body: dict[str, Any], key: str) -> str:
        """'' on success, else why it failed."""
        try:
            response = await self.client.post(
                str(notifier.url),
                json=body,
                headers={IDEMPOTENCY_HEADER: key},
                timeout=notifier.timeout_seconds,
            )
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        return "" if response.is_success else f"HTTP {response.status_code}"

    async def _failed(
        self, notifier: Notifier, event: dict[str, Any], error: str, attempts: int, age: float
    ) -> None:
        """A dead letter: counted, logged, and recorded for GET /v1/notifiers."""
        self.metrics.notifier_failures.labels(notifier.name).inc()
        log.warning(
            "notifier %s: event %s dead-lettered after %d attempts in %.0f s: %s",
            notifier.name,
            event["id"],
            attempts,
            age,
            error,
        )
        record = {
            "notifier": notifier.name,
            "event": event["id"],
            "session": event["session"],
            "kind": event.get("kind") or "",
            "namespace": event.get("namespace") or "",  # GET /v1/notifiers filters on it
            "error": error,
        }
        with contextlib.suppress(Exception):  # a lost record must not kill the task
            await self.redis.xadd(
                keys.NOTIFIER_FAILURES,
                {
                    **record,
                    "attempts": str(attempts),
                    "age": f"{age:.1f}",
                    "time": str(time.time()),
                },
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
        tasks = list(self.running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            task.cancel()
        await self.client.aclose()


def current(
    events: list[dict[str, Any]], sessions: Mapping[str, SessionOut]
) -> list[dict[str, Any]]:
    """The events without the stale ones: a non-final state change (``parked``,
    ``stall``, ...) for a session already finished, before this batch or earlier
    in it. The ingest script keeps such a session finished; a notification would
    invite someone to attach to a process that is gone."""
    ended = {sid for sid, s in sessions.items() if s.state in protocol.FINAL_STATES}
    kept = []
    for event in events:
        state = protocol.STATE_OF_KIND.get(event["kind"])
        if state in protocol.FINAL_STATES:
            ended.add(event["session"])
        elif state is not None and event["session"] in ended:
            continue
        kept.append(event)
    return kept


def _enqueued(entry_id: str) -> float:
    """A stream id starts with the milliseconds at which the job was queued."""
    return int(entry_id.split("-", 1)[0]) / 1000


def _session_json(sessions: Mapping[str, SessionOut], event: dict[str, Any]) -> str:
    session = sessions.get(event["session"])
    return session.model_dump_json() if session is not None else ""


def _session(raw: str | None) -> SessionOut | None:
    return SessionOut.model_validate_json(raw) if raw else None
