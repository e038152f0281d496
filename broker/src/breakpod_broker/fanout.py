"""One Redis read loop per replica, fanned out in-process to every SSE follower.

A replica reads the global event stream once (XREAD BLOCK on its own
connection), decodes and encodes each event once, and offers the SSE text to
the followers that may see it: those of every namespace, plus those whose
token is limited to the event's namespace. A follower costs a bounded queue,
not a Redis connection or a round trip.

A follower that falls ``queue`` events behind is dropped: its stream ends and
the client reconnects with Last-Event-ID, catching up from Redis. The loop
never waits for a follower, so followers never slow ingest.

A client that stops reading (its socket's buffers full) would block its
stream's next write forever, and hold its follower's place: each write must
finish within ``stream_stall_seconds`` (:class:`SSEResponse`), or the stream
ends and the connection closes.

A stream first catches up from Redis (XRANGE from its start) and only then
takes events from its queue, skipping those it already sent: it subscribes
before it reads Redis, so no event falls between the two.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from breakpod_broker import keys
from breakpod_broker.wakeups import settle, wait_settled

log = logging.getLogger(__name__)
READ_COUNT = 1000
BLOCK_MS = 2000
CATCH_UP_CHUNK = 500
RETRY_SECONDS = 1.0
DRAIN = 500  # queued events a stream writes at once

Cursor = tuple[int, int]
T = TypeVar("T")
Wants = Callable[[dict[str, Any]], bool]  # a follower's filter


def cursor_of(entry_id: str) -> Cursor:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def sse_text(entry_id: str, doc: dict[str, Any]) -> str:
    data = json.dumps(doc, allow_nan=False)
    return f"id: {entry_id}\nevent: {doc['kind']}\ndata: {data}\n\n"


class Follower:
    """One SSE stream's place in the fan-out: a bounded queue of (cursor, SSE text), and
    a future that wakes its stream (no task and no ``wait_for`` per wake)."""

    __slots__ = ("dropped", "namespaces", "pending", "size", "wants", "woken")

    def __init__(self, namespaces: frozenset[str] | None, wants: Wants | None, size: int) -> None:
        self.namespaces = namespaces  # None: every namespace
        self.wants = wants  # None: every event it may see
        self.size = size
        self.pending: collections.deque[tuple[Cursor, str]] = collections.deque()
        self.dropped = False
        self.woken: asyncio.Future[None] | None = None  # set while its stream waits

    def offer(self, cursor: Cursor, text: str) -> None:
        if self.dropped:
            return
        if len(self.pending) < self.size:
            self.pending.append((cursor, text))
        else:  # too slow: it resumes from Redis with Last-Event-ID
            self.dropped = True
        if self.woken is not None:
            settle(self.woken)

    async def wait(self, seconds: float) -> None:
        """Until an event is queued or this follower is dropped; ``seconds`` at most."""
        if self.pending or self.dropped:
            return
        self.woken = asyncio.get_running_loop().create_future()
        try:
            await wait_settled(self.woken, seconds)
        finally:
            self.woken = None

    def take(self, most: int) -> list[tuple[Cursor, str]]:
        """Up to ``most`` queued events, oldest first: one socket write for them all, so
        a busy stream costs a send per burst, not per event."""
        pending = self.pending
        return [pending.popleft() for _ in range(min(most, len(pending)))]


class EventFanout:
    """The replica's one reader of keys.EVENTS and its followers."""

    def __init__(
        self, blocking: Any, queue_size: int, decode: Callable[[str, Any], dict[str, Any] | None]
    ) -> None:
        self.redis = blocking
        self.decode = decode  # events._decode: the same for pages and streams
        self.queue_size = queue_size
        self.everywhere: set[Follower] = set()
        self.by_namespace: dict[str, set[Follower]] = {}
        self.dropped = 0  # followers dropped for being slow, since start
        self._task: asyncio.Task[None] | None = None

    @property
    def followers(self) -> int:
        return len(self.everywhere) + sum(map(len, self.by_namespace.values()))

    async def start(self) -> None:
        """Read from the stream's end; with Redis away, from its start (followers skip
        what they already sent, so that costs one pass, never a duplicate)."""
        try:
            last = await self.redis.xrevrange(keys.EVENTS, "+", "-", count=1)
        except Exception as e:  # the broker starts without Redis; /readyz says so
            log.warning("event fan-out: Redis unavailable at start (%s)", e)
            last = []
        self._task = asyncio.create_task(self._run(str(last[0][0]) if last else "0-0"))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def follow(self, namespaces: frozenset[str] | None, wants: Wants | None) -> Any:
        follower = Follower(namespaces, wants, self.queue_size)
        groups = (
            [self.everywhere]
            if namespaces is None
            else [self.by_namespace.setdefault(n, set()) for n in namespaces]
        )
        for group in groups:
            group.add(follower)
        try:
            yield follower
        finally:
            for group in groups:
                group.discard(follower)
            for n in namespaces or ():
                if not self.by_namespace.get(n, True):
                    del self.by_namespace[n]
            self.dropped += follower.dropped

    async def _run(self, cursor: str) -> None:
        while True:
            try:
                reply = await self.redis.xread({keys.EVENTS: cursor}, READ_COUNT, BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: followers wait, the loop retries
                log.warning("event fan-out: reading Redis failed (%s); retrying", e)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            for entry_id, fields in reply[0][1] if reply else ():
                cursor = entry_id
                if self.everywhere or self.by_namespace:
                    doc = self.decode(entry_id, fields)
                    if doc is not None:
                        self._offer(entry_id, doc)
            await asyncio.sleep(0)

    def _offer(self, entry_id: str, doc: dict[str, Any]) -> None:
        text = None
        position = cursor_of(entry_id)
        ns = doc.get("namespace") or ""
        for follower in (*self.everywhere, *self.by_namespace.get(ns, ())):
            if follower.wants is None or follower.wants(doc):
                text = text or sse_text(entry_id, doc)
                follower.offer(position, text)


async def stream(
    fanout: EventFanout,
    follower: Follower,
    catch_up: Callable[[str], Any],
    start: str,
    still_allowed: Callable[[], Any],
    *,
    max_seconds: float,
    recheck_seconds: float,
    keepalive_seconds: float = BLOCK_MS / 1000,
) -> AsyncIterator[str]:
    """The SSE body: catch up from Redis after ``start`` (``catch_up(after)`` answers
    the matching (id, doc) pairs of one chunk and the last id it read, None at the
    end), then the follower's queue; ends when dropped, revoked or after ``max_seconds``."""
    yield "retry: 1000\n\n"
    started = checked = time.monotonic()
    after: str | None = start
    sent = cursor_of(start)
    while after is not None:
        sent = cursor_of(after)
        matching, after = await catch_up(after)
        for entry_id, doc in matching:
            yield sse_text(entry_id, doc)
    while time.monotonic() - started < max_seconds:
        if time.monotonic() - checked >= recheck_seconds:
            if not await still_allowed():
                return  # the client gets 401 when it reconnects
            checked = time.monotonic()
        await follower.wait(keepalive_seconds)
        if not follower.pending:
            if follower.dropped:
                return  # too slow: the client resumes with Last-Event-ID
            yield ": keepalive\n\n"
            continue
        parts = []
        for position, text in follower.take(DRAIN):
            if position > sent:
                sent = position
                parts.append(text)
        if parts:
            yield "".join(parts)


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` whose every write finishes within ``stall_seconds``."""

    def __init__(self, body: AsyncIterator[str], stall_seconds: float) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.stall_seconds = stall_seconds

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            await within(self.stall_seconds, send(message))

        try:
            await super().stream_response(send_in_time)
        except TimeoutError:  # the server closes the connection of an unfinished response
            log.info("an SSE client took nothing for %gs: its stream ends", self.stall_seconds)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or TimeoutError after ``seconds``: without a task per call
    where asyncio has ``timeout`` (Python 3.11), else through ``wait_for``."""
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable


_timeout = getattr(asyncio, "timeout", None)
