"""Command long-polls woken by one subscription per replica, not one Redis call per waiter.

Queuing a command publishes the session id on keys.COMMANDS_QUEUED (in the
same pipeline as the LPUSH, so after it). Each replica holds one subscription
and wakes the polls waiting on that session, which then move the command with
a plain LMOVE: delivery stays at least once through the ``delivered`` list. A
waiting poll costs a future (and a timer), so there is no cap on waiters.

A job-wide command (joblog.py) publishes its job's command stream key on
keys.JOB_COMMANDS_QUEUED instead: one message wakes every poll of that job's
sessions on each replica. The replica reads the job's new entries once per
cursor its waiting polls hold (usually one: they acknowledged the same
commands), with ``read_job``, and hands each poll that reading: 10,000 polls
woken by one ``break`` cost one XRANGE, not 10,000. A waiter says which of
the two woke it, so a poll woken for its job does not also look at its own queue.

Pub/sub may lose a message while the subscription reconnects: after each
(re)subscription every waiter re-checks its queue, and each poll checks once
more when its wait ends, so a command is at worst late, never lost. When the
broker begins to shut down (``shut``), every waiter wakes at once and its poll
answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from breakpod_broker import keys

log = logging.getLogger(__name__)
LISTEN_SECONDS = 5.0  # one read of the subscription; the loop then reads again
RETRY_SECONDS = 1.0

# (job command stream, cursor) -> the entries after the cursor (joblog.after)
ReadJob = Callable[[str, str], Awaitable[list[Any]]]


def settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def wait_settled(future: asyncio.Future[None], seconds: float) -> None:
    """Until ``future`` is settled (see :func:`settle`), ``seconds`` at most: a timer,
    not a task per wait as ``asyncio.wait_for`` makes."""
    if future.done():
        return
    timer = asyncio.get_running_loop().call_later(seconds, settle, future)
    try:
        await future
    finally:
        timer.cancel()


class Waiter:
    """One poll's wake-up: ``future`` done when its session's or its job's command came
    (or the broker shuts down)."""

    __slots__ = ("cursor", "found", "future", "job", "own")

    def __init__(self, cursor: str | None) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.own = True  # look at the session's own queue (first look: both)
        self.job = True  # look at the job's command stream
        self.cursor = cursor  # where the session reads its job's stream (None: no job)
        self.found: list[Any] | None = None  # the job's entries after ``cursor``, read for it

    def wake(self, own: bool, job: bool, found: list[Any] | None = None) -> None:
        self.own |= own
        self.job |= job
        if found is not None:
            self.found = found
        settle(self.future)

    def clear(self) -> None:
        self.own = self.job = False
        self.found = None
        if self.future.done():
            self.future = asyncio.get_running_loop().create_future()

    async def wait(self, seconds: float) -> None:
        """Until woken, or ``seconds`` at most."""
        await wait_settled(self.future, seconds)


class CommandWakeups:
    """The replica's subscription and the polls waiting on each session."""

    def __init__(self, client: Any, read_job: ReadJob | None = None) -> None:
        self.redis = client  # its own client: a subscribed connection serves nothing else
        self.read_job = read_job  # None: woken polls read their job's stream themselves
        self.waiting: dict[str, set[Waiter]] = {}  # by session id
        self.waiting_jobs: dict[str, set[Waiter]] = {}  # by job command stream key
        self.subscribed = asyncio.Event()
        self.closing = False  # the broker shuts down: polls answer 503
        self._task: asyncio.Task[None] | None = None
        self._reads: set[asyncio.Task[None]] = set()

    @property
    def waiters(self) -> int:
        return sum(map(len, self.waiting.values()))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        with contextlib.suppress(asyncio.TimeoutError):  # Redis down: polls still time out
            await asyncio.wait_for(self.subscribed.wait(), LISTEN_SECONDS)

    def shut(self) -> None:
        """The broker begins to shut down: every waiting poll wakes and answers 503."""
        self.closing = True
        for group in self.waiting.values():
            for woken in group:
                woken.wake(own=False, job=False)

    async def close(self) -> None:
        for task in [self._task, *self._reads]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.redis.aclose()

    @contextlib.contextmanager
    def waiter(
        self, session_id: str, job_stream: str | None = None, cursor: str | None = None
    ) -> Iterator[Waiter]:
        """Woken when a command is queued for ``session_id``, or one is sent to the job
        whose command stream is ``job_stream`` (on any replica); ``cursor``: the
        session's place in that stream."""
        woken = Waiter(cursor if job_stream is not None else None)
        if self.closing:
            woken.wake(own=False, job=False)
        groups = [(self.waiting, session_id)]
        if job_stream is not None:
            groups.append((self.waiting_jobs, job_stream))
        for by, key in groups:
            by.setdefault(key, set()).add(woken)
        try:
            yield woken
        finally:
            for by, key in groups:
                group = by.get(key)
                if group is not None:
                    group.discard(woken)
                    if not group:
                        del by[key]

    async def _run(self) -> None:
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(keys.COMMANDS_QUEUED, keys.JOB_COMMANDS_QUEUED)
                    self.subscribed.set()
                    self._wake_all()  # what was queued while not subscribed
                    while True:
                        message = await pubsub.get_message(True, timeout=LISTEN_SECONDS)
                        if message is not None:
                            self._wake(str(message["channel"]), str(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: polls end at their timeout meanwhile
                self.subscribed.clear()
                log.warning("command wake-ups: subscription failed (%s); retrying", e)
                await asyncio.sleep(RETRY_SECONDS)

    def _wake(self, channel: str, key: str) -> None:
        if channel != keys.JOB_COMMANDS_QUEUED:
            for woken in self.waiting.get(key, ()):
                woken.wake(own=True, job=False)
            return
        group = self.waiting_jobs.get(key)
        if not group:
            return
        if self.read_job is None:
            for woken in group:
                woken.wake(own=False, job=True)
            return
        by_cursor: dict[str, list[Waiter]] = {}
        for woken in group:
            by_cursor.setdefault(woken.cursor or "", []).append(woken)
        for cursor, waiters in by_cursor.items():
            task = asyncio.create_task(self._read_for(key, cursor, waiters))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _read_for(self, stream: str, cursor: str, waiters: list[Waiter]) -> None:
        """Read the job's entries after ``cursor`` once, for every poll waiting with it;
        a failed read wakes them anyway (each reads for itself, and answers 503 if
        Redis is away)."""
        assert self.read_job is not None
        found = None
        try:
            found = await self.read_job(stream, cursor)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("command wake-ups: reading %s failed (%s)", stream, e)
        for woken in waiters:
            woken.wake(own=False, job=True, found=found)

    def _wake_all(self) -> None:
        for group in self.waiting.values():
            for woken in group:
                woken.wake(own=True, job=True)
