"""Command long-polls woken by one subscription per replica, not one Redis call per waiter.

Queuing a command publishes the session id on keys.COMMANDS_QUEUED (in the
same pipeline as the LPUSH, so after it). Each replica holds one subscription
and wakes the polls waiting on that session, which then move the command with
a plain LMOVE: delivery stays at least once through the ``delivered`` list. A
waiting poll costs an asyncio.Event, so there is no cap on waiters.

A job-wide command (joblog.py) publishes its job's command stream key on
keys.JOB_COMMANDS_QUEUED instead: one message wakes every poll of that job's
sessions on each replica. A waiter says which of the two woke it, so a poll
woken for its job does not also look at its own queue.

Pub/sub may lose a message while the subscription reconnects: after each
(re)subscription every waiter re-checks its queue, and each poll checks once
more when its wait ends, so a command is at worst late, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from breakpod_broker import keys

log = logging.getLogger(__name__)
LISTEN_SECONDS = 5.0  # one read of the subscription; the loop then reads again
RETRY_SECONDS = 1.0


class Waiter:
    """One poll's wake-up: ``event`` set when its session's or its job's command came."""

    __slots__ = ("event", "job", "own")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.own = True  # look at the session's own queue (first look: both)
        self.job = True  # look at the job's command stream

    def wake(self, own: bool, job: bool) -> None:
        self.own |= own
        self.job |= job
        self.event.set()

    def clear(self) -> None:
        self.own = self.job = False
        self.event.clear()


class CommandWakeups:
    """The replica's subscription and the polls waiting on each session."""

    def __init__(self, client: Any) -> None:
        self.redis = client  # its own client: a subscribed connection serves nothing else
        self.waiting: dict[str, set[Waiter]] = {}  # by session id
        self.waiting_jobs: dict[str, set[Waiter]] = {}  # by job command stream key
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def waiters(self) -> int:
        return sum(map(len, self.waiting.values()))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        with contextlib.suppress(asyncio.TimeoutError):  # Redis down: polls still time out
            await asyncio.wait_for(self.subscribed.wait(), LISTEN_SECONDS)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.redis.aclose()

    @contextlib.contextmanager
    def waiter(self, session_id: str, job_stream: str | None = None) -> Iterator[Waiter]:
        """Woken when a command is queued for ``session_id``, or one is sent to the job
        whose command stream is ``job_stream`` (on any replica)."""
        woken = Waiter()
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
        job = channel == keys.JOB_COMMANDS_QUEUED
        for woken in (self.waiting_jobs if job else self.waiting).get(key, ()):
            woken.wake(own=not job, job=job)

    def _wake_all(self) -> None:
        for group in self.waiting.values():
            for woken in group:
                woken.wake(own=True, job=True)
