"""This process's link to the broker: the emitter ships the hub's events, and hands
the commands the broker sends back to a callback (:func:`connect` passes
:func:`breakpod._link.commands.run`, which knows what each command does).

The layers below ask for the link through :func:`breakpod._core.wiring.connect`;
the package's face installs :func:`connect` there, so none of them imports this.

Enabled by ``BREAKPOD_BROKER_URL`` (token: ``BREAKPOD_AGENT_TOKEN``); without it
nothing here runs: no thread, no sink, no socket. The training thread only
appends to a bounded in-memory queue (when full the oldest event is dropped
and counted); a sender thread posts batches with retry and backoff (jittered,
capped at MAX_BACKOFF so delivery resumes within seconds of the broker's
return), and a poller thread long-polls commands (``break``, ``resume``,
``detach``, ``dump-stacks``).

Counters are exact: every event emitted is, at any moment, in exactly one of
``sent``, ``rejected``, ``dropped``, the queue, or the batch in flight. The
batch in flight keeps its room in the queue, so a batch whose outcome is
unknown (a timeout; it may land late) goes back in front and is sent again
(the broker drops the duplicate ids), never counted as dropped.

    emitter.connect()              # idempotent: the process's emitter, or None
    emitter.ensure_started()       # the same, asked through the wiring slot
    breakpod.break_if_requested()  # at a step boundary: park here after a `break`
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from breakpod import protocol
from breakpod._core import events, identity, threads, wiring
from breakpod._core.announce import announce
from breakpod._core.config import AGENT_TOKEN_ENV, BROKER_URL_ENV, parse_int, token_value
from breakpod._core.errors import BreakpodError, BrokerRequestError, ConfigError
from breakpod._core.events import pending_break, request_break
from breakpod._link import commands, exit_report
from breakpod._link.client import BrokerClient

log = logging.getLogger(__name__)

ENV_QUEUE = "BREAKPOD_EMIT_QUEUE"
# What the agent sends (the broker records "command" events itself); anything
# else travels as protocol.FALLBACK_KIND.
KINDS = protocol.AGENT_EVENT_KINDS
STATE_OF_KIND = protocol.STATE_OF_KIND
BATCH_EVENTS = 500
BATCH_BYTES = 512 * 1024
MAX_EVENT_BYTES = 64 * 1024
HEARTBEAT_SECONDS = 15.0  # until the broker asks for another interval (heartbeat_seconds)
MAX_HEARTBEAT_SECONDS = 300.0
POLL_SECONDS = 20.0
FIRST_BACKOFF = 0.25
MAX_BACKOFF = 2.0
FINAL_SECONDS = 3.0  # the longest an exit waits for its final event (a slow broker, not a dead one)

# (ok, detail) for a command name; the detail goes back in the acknowledgement.
CommandHandler = Callable[[str], tuple[bool, str]]
__all__ = ["Emitter", "connect", "ensure_started", "pending_break", "request_break", "start_once"]

_lock = threading.Lock()
_emitter: Emitter | None = None
_start_failed = False


def connect() -> Emitter | None:
    """Start reporting (idempotent), the broker's commands answered by
    :mod:`breakpod._link.commands`; ``None`` when no broker is configured."""
    return start_once(on_command=commands.run)


def ensure_started() -> Emitter | None:
    """The process's emitter, started on first call through the broker link
    (commands handled); ``None`` when no broker is configured."""
    if _emitter is None and not _start_failed and os.environ.get(BROKER_URL_ENV):
        wiring.connect()
    return _emitter


def start_once(on_command: CommandHandler) -> Emitter | None:
    """Start the process's emitter (idempotent); ``None`` without a broker or when
    its settings are bad (announced once)."""
    global _emitter, _start_failed
    if _emitter is not None or _start_failed or not os.environ.get(BROKER_URL_ENV):
        return _emitter
    with _lock:
        if _emitter is None and not _start_failed:
            try:
                _emitter = Emitter.from_env(on_command=on_command).start()
            except (BreakpodError, ValueError) as e:
                _start_failed = True
                announce(f"not reporting to the broker: {e}")
    return _emitter


def _no_commands(name: str) -> tuple[bool, str]:
    return False, f"this agent handles no commands ({name!r} ignored)"


class Emitter:
    """A session at the broker: a queue, a sender thread and a command poller thread."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        session_id: str | None = None,
        info: dict[str, Any] | None = None,
        queue_size: int = 10_000,
        poll_commands: bool = True,
        on_command: CommandHandler = _no_commands,
    ) -> None:
        self.session_id = session_id or identity.session_id()
        self.info = identity.describe() if info is None else info
        self.queue_size = max(1, queue_size)
        self.dropped = self.sent = self.rejected = 0
        self.in_flight = 0  # taken by the sender, outcome not known yet
        self.on_command = on_command
        self.state: dict[str, Any] = {"state": protocol.INITIAL_STATE}
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._qlock = threading.Lock()
        self._seq = itertools.count(1)
        self._wake, self._stop, self._idle = threading.Event(), threading.Event(), threading.Event()
        self._hurry = threading.Event()  # ends a backoff wait: finish() or close() wants a try now
        self._tries = threading.Condition()  # the sender's tries, counted: finish() waits for one
        self._tries_started = self._tries_ended = 0
        self._registered = threading.Event()
        self._next_beat = 0.0
        self.beat_seconds = HEARTBEAT_SECONDS  # what the broker last asked for
        self._warned: set[str] = set()
        self.url = url
        self._client = BrokerClient(url, token, timeout=5.0)
        self._poller = (
            BrokerClient(url, token, timeout=POLL_SECONDS + 10) if poll_commands else None
        )
        self._threads: list[threading.Thread] = []

    @classmethod
    def from_env(cls, on_command: CommandHandler = _no_commands) -> Emitter:
        size = parse_int(ENV_QUEUE, os.environ.get(ENV_QUEUE, "10000"))  # ConfigError: announced
        if size < 1:  # it became 1 without a word
            raise ConfigError(f"{ENV_QUEUE}={size} is not a positive number of events")
        url, token = os.environ[BROKER_URL_ENV], token_value(AGENT_TOKEN_ENV)
        return cls(url, token, queue_size=size, on_command=on_command)

    def start(self) -> Emitter:
        targets = [self._send_loop] + ([self._poll_loop] if self._poller is not None else [])
        for target in targets:
            self._threads.append(threads.start_daemon(target, f"breakpod{target.__name__}"))
        events.add_sink(self.sink)
        atexit.register(self.finish)
        exit_report.install(self.finish)
        self._wake.set()
        return self

    # -- the training thread's side: append and return ---------------------------------

    def emit(
        self, kind: str, fields: dict[str, Any] | None = None, *, at: float | None = None
    ) -> None:
        """Queue an event; never blocks on the network. Unknown kinds travel as ``log``."""
        fields = dict(fields or {})
        if kind not in KINDS:
            kind, fields = protocol.FALLBACK_KIND, {**fields, "event": kind}
        doc: dict[str, Any] = {"id": f"{self.session_id}.{next(self._seq)}", "kind": kind}
        doc.update(session=self.session_id, time=at or time.time(), fields=fields)
        self._track_state(kind, fields)
        with self._qlock:
            self._idle.clear()
            if len(self._queue) + self.in_flight >= self.queue_size:
                self.dropped += 1
                if not self._queue:  # all the room is in flight: this one cannot wait
                    return
                self._queue.popleft()
            self._queue.append(doc)
        self._wake.set()

    def sink(self, event: events.Event) -> None:
        self.emit(event.kind, event.fields, at=event.time)

    def _track_state(self, kind: str, fields: dict[str, Any]) -> None:
        """Kept so a re-registration (broker lost its Redis) restores the session."""
        state = STATE_OF_KIND.get(kind)
        if state is not None:
            reason = fields.get("reason") or fields.get("why")  # as the broker records it
            self.state = {**self.state, "state": state, "reason": reason}
        if kind in protocol.LISTENER_KINDS and fields.get("address"):
            backend = fields.get("backend", protocol.DEFAULT_LISTENER)
            self.state = {**self.state, "address": fields["address"], "listener": backend}

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued was sent (or rejected); False on timeout."""
        self._wake.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        events.remove_sink(self.sink)
        self._stop.set()
        self._hurry.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)

    def finish(self, how: dict[str, Any] | None = None) -> None:
        """At exit (or SIGTERM): report ``finished`` with its ``exit`` status or
        ``signal``. The sender, woken even from a backoff wait, tries once more
        right away; the exit waits for that one try only (a broker that is down
        refuses at once), and one stderr line says so when the broker missed it."""
        if self._stop.is_set():
            return
        how = how or exit_report.status()
        self.emit(protocol.FINISHED, {"reason": "process exited", **how})
        delivered = self._try_now(FINAL_SECONDS)
        self.close(timeout=0.5)
        if not delivered:
            ended = ", ".join(f"{k} {v}" for k, v in how.items())
            announce(
                f"the broker at {self.url} did not get this process's exit ({ended}); "
                f"session {self.session_id} will read as lost there"
            )

    def _try_now(self, timeout: float) -> bool:
        """Wake the sender for a try that starts after this call and wait for its end
        (at most ``timeout``); True when nothing is left to send."""
        with self._tries:
            wanted = self._tries_started + 1
            self._hurry.set()
            self._wake.set()
            self._tries.wait_for(lambda: self._tries_ended >= wanted, timeout)
        with self._qlock:
            return not self._queue and not self.in_flight

    # -- the sender thread --------------------------------------------------------------

    def _send_loop(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            self._wake.wait(timeout=HEARTBEAT_SECONDS / 3)
            self._wake.clear()
            self._hurry.clear()
            if self._counted_try():
                backoff = FIRST_BACKOFF
                continue
            if self._stop.is_set():
                return
            hurried = self._hurry.wait(jittered(backoff))
            backoff = FIRST_BACKOFF if hurried else min(backoff * 2, MAX_BACKOFF)
            self._wake.set()

    def _counted_try(self) -> bool:
        """One try, counted for :meth:`_try_now`."""
        with self._tries:
            self._tries_started += 1
            number = self._tries_started
        try:
            return self._try()
        finally:
            with self._tries:
                self._tries_ended = number
                self._tries.notify_all()

    def _try(self) -> bool:
        """Register (or beat) and send everything queued; False when that failed."""
        try:
            self._register_or_beat()
            while self._send_batch():
                pass
            return True
        except BrokerRequestError as e:
            if e.status == 422 and not self._registered.is_set():  # retrying cannot help
                announce(f"the broker refused this session, not reporting to it: {e}")
                self._stop.set()
                return False
            self._warn_once("send", f"broker unreachable, events queued ({e})")
        except Exception as e:  # a bug here must not kill reporting, nor the job
            self._warn_once("send-bug", f"reporting failed ({type(e).__name__}: {e})")
        return False

    def _register_or_beat(self) -> None:
        now = time.monotonic()
        try:
            if not self._registered.is_set():
                reply = self._client.register(self.session_id, {**self.info, **self.state})
                self._registered.set()
            elif now >= self._next_beat:
                reply = self._client.heartbeat(self.session_id, events.last_step())
            else:
                return
        except BrokerRequestError as e:
            if e.status == 404:
                self._registered.clear()
            raise
        self.beat_seconds = asked_interval(reply)
        # a little early, at random: thousands of agents of one job do not beat in waves,
        # and never later than asked (the broker counts missed beats of this interval)
        self._next_beat = now + self.beat_seconds * random.uniform(0.8, 1.0)

    def _send_batch(self) -> bool:
        """Send one batch; False when the queue is empty."""
        batch, body = self._take()
        if not batch:
            return False
        try:
            self._client.post_events(body)
        except BrokerRequestError as e:
            if e.status in (400, 403, 413, 422):  # retrying cannot help: drop, count, say so
                self._settle(batch, rejected=True)
                self._warn_once("rejected", f"the broker rejected {len(batch)} events: {e}")
                return True
            if e.status == 404:
                self._registered.clear()
            self._requeue(batch)
            raise
        except BaseException:  # a bug: the events go back, the counters stay exact
            self._requeue(batch)
            raise
        self._settle(batch, rejected=False)
        return True

    def _settle(self, batch: list[dict[str, Any]], *, rejected: bool) -> None:
        with self._qlock:
            self.in_flight -= len(batch)
            if rejected:
                self.rejected += len(batch)
            else:
                self.sent += len(batch)

    def _take(self) -> tuple[list[dict[str, Any]], bytes]:
        """Up to BATCH_EVENTS / BATCH_BYTES from the front; encoded outside the lock so
        the training thread's emit() never waits for JSON encoding."""
        with self._qlock:
            batch = [self._queue.popleft() for _ in range(min(BATCH_EVENTS, len(self._queue)))]
            if not batch:
                self._idle.set()  # under the lock: an emit() right now clears it again
                return [], b""
            self.in_flight += len(batch)
        parts: list[bytes] = []
        size = 0
        for doc in batch:
            if parts and size >= BATCH_BYTES:
                break
            parts.append(_encode(doc))
            size += len(parts[-1])
        if len(parts) < len(batch):
            self._requeue(batch[len(parts) :])
        return batch[: len(parts)], b'{"events":[' + b",".join(parts) + b"]}"

    def _requeue(self, batch: list[dict[str, Any]]) -> None:
        """Put a batch back in front; the room it kept while in flight is still there."""
        with self._qlock:
            self.in_flight -= len(batch)
            self._queue.extendleft(reversed(batch))

    # -- the poller thread --------------------------------------------------------------

    def _poll_loop(self) -> None:
        assert self._poller is not None
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            if not self._registered.wait(timeout=1.0):
                continue
            try:
                for command in self._poller.poll(self.session_id, POLL_SECONDS):
                    self._run(command)
                backoff = FIRST_BACKOFF
            except Exception as e:  # never let the poller die: commands would stop
                if isinstance(e, BrokerRequestError) and e.status == 404:
                    self._registered.clear()
                    self._wake.set()
                elif isinstance(e, BrokerRequestError) and e.status == 429:  # the replica is full
                    backoff = max(backoff, 5.0)
                elif not isinstance(e, BrokerRequestError):
                    self._warn_once("poll-bug", f"command poll failed ({type(e).__name__}: {e})")
                self._stop.wait(jittered(backoff))
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _run(self, command: dict[str, Any]) -> None:
        try:
            ok, detail = self.on_command(command["command"])
        except Exception as e:  # a command must never take the process down
            ok, detail = False, f"{type(e).__name__}: {e}"
        assert self._poller is not None
        self._poller.ack(self.session_id, command["id"], ok, detail)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("breakpod: %s", message)


def asked_interval(reply: Any) -> float:
    """The interval the broker asks for (it grows with the sessions it holds); an
    older broker asks for none: HEARTBEAT_SECONDS."""
    asked = reply.get("heartbeat_seconds") if isinstance(reply, dict) else None
    if not isinstance(asked, int | float) or isinstance(asked, bool) or not asked > 0:
        return HEARTBEAT_SECONDS
    return min(float(asked), MAX_HEARTBEAT_SECONDS)


def jittered(seconds: float) -> float:
    """Between half and all of ``seconds``: agents that lost the same broker
    do not all come back in the same instant."""
    return seconds * random.uniform(0.5, 1.0)


def _encode(doc: dict[str, Any]) -> bytes:
    encoded = protocol.dumps(doc).encode()
    if len(encoded) <= MAX_EVENT_BYTES:
        return encoded
    preview = protocol.dumps(doc["fields"])[:4096]
    return _encode({**doc, "fields": {"truncated": True, "preview": preview}})


def _forget_after_fork() -> None:
    """A forked child (a DataLoader worker) has no sender thread: stay silent there."""
    global _emitter
    if _emitter is not None:
        events.remove_sink(_emitter.sink)
        _emitter._stop.set()  # its atexit finish() returns at once
        _emitter = None


os.register_at_fork(after_in_child=_forget_after_fork)
