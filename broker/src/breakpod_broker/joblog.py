"""Job-wide commands: stored once per job, read by each session from its own cursor.

``POST /v1/jobs/{job}/commands`` is one XADD to the job's command stream
(keys.job_commands) and one PUBLISH, whatever the number of sessions: O(1)
Redis writes where one command per session was O(sessions). Each session of the
job keeps a cursor in its hash (keys.JOB_CURSOR_FIELD): the last entry it
acknowledged. Its long poll hands out the entries after the cursor together
with its own commands; its acknowledgement moves the cursor forward (a Lua
script). So each session gets each job command once: redelivered until it is
acknowledged, exactly as its own commands are.

Who gets a command: the sessions registered when it was sent. A session's
cursor starts at the stream's last entry when the session is first registered
(re-registrations keep it; one under another job starts afresh in that job's
stream), so a rank started or restarted under a new session
id after a ``break`` does not park for that old ``break``, and an old ``resume``
does not reach it either: both were meant for the ranks that were there.

Replicas wake the polls of a job's sessions through the one subscription they
already hold (wakeups.py, keys.JOB_COMMANDS_QUEUED), and read the stream for
them once per cursor (``after``), not once each. Each entry is decoded and
encoded once per replica (:class:`Entry`): a poll's answer is the entry's JSON
with the session id put in, not a model validated and serialized per poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from breakpod_broker import keys
from breakpod_broker.context import Broker
from breakpod_broker.models import Command, JobCommand, JobCommandIn, SessionOut

FIELD = "doc"  # the stream entry's one field: the JobCommand's JSON
START = "0-0"  # the cursor of a session whose job has no command yet
ACK_SCAN = 1000  # entries after its cursor an acknowledgement looks through
MAX_PER_POLL = 16
ENCODED_KEPT = 1000  # entries kept encoded per replica (a job's commands: a handful)
PLACEHOLDER = "\x00"  # never in a session id (protocol.SESSION_ID_PATTERN)
PLACEHOLDER_JSON = b'"\\u0000"'  # how pydantic writes it


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """A job command as read from its stream, encoded once for every session: a
    session's copy is ``head`` + the session id as JSON + ``tail``, byte for byte
    what ``command.to(session_id).model_dump_json()`` writes."""

    entry_id: str
    command: JobCommand
    head: bytes
    tail: bytes

    @classmethod
    def decode(cls, entry_id: str, raw: str) -> Entry:
        command = JobCommand.model_validate_json(raw)
        head, mark, tail = (
            command.to(PLACEHOLDER).model_dump_json().encode().partition(PLACEHOLDER_JSON)
        )
        assert mark, "the placeholder session id is in the encoded command"
        return cls(entry_id, command, head, tail)

    def json_for(self, session_id: str) -> bytes:
        """The command as ``session_id`` receives it, as JSON."""
        return self.head + json.dumps(session_id).encode() + self.tail


def stream_of(session: SessionOut) -> str | None:
    """The session's job command stream; None for a session without a job."""
    return keys.job_commands(session.namespace or "", session.job) if session.job else None


async def last_id(broker: Broker, stream: str) -> str:
    """The id of the stream's newest entry: a new session's cursor (nothing before it)."""
    newest = await broker.redis.xrevrange(stream, "+", "-", count=1)
    return str(newest[0][0]) if newest else START


async def start_cursor(broker: Broker, session_id: str, stream: str, cursor: str) -> str:
    """The session's cursor in ``stream``: the one it has there (re-registrations keep
    it), else ``cursor``, set now. (A cursor kept before the stream was noted with it is
    taken to be in ``stream``.)"""
    key = keys.session(session_id)
    kept, kept_in = await broker.redis.hmget(key, [keys.JOB_CURSOR_FIELD, keys.JOB_STREAM_FIELD])
    if kept is not None and kept_in in (stream, None):
        return str(kept)
    await broker.redis.hset(
        key, mapping={keys.JOB_CURSOR_FIELD: cursor, keys.JOB_STREAM_FIELD: stream}
    )
    return cursor


async def append(broker: Broker, job: str, body: JobCommandIn, by: str) -> JobCommand:
    """Store the command once for the whole job, then wake the replicas' polls of that job."""
    command = JobCommand(
        **body.model_dump(exclude={"namespace"}),
        id=uuid.uuid4().hex[:16],
        job=job,
        namespace=body.namespace,
        created=time.time(),
        by=by,
    )
    stream = keys.job_commands(body.namespace or "", job)
    s = broker.settings
    # stored, then published: the wake-up never comes before the command (in a
    # Redis Cluster the two go to different nodes, so not one transaction)
    async with broker.redis.pipeline(transaction=not broker.cluster) as pipe:
        pipe.xadd(
            stream,
            {FIELD: command.model_dump_json()},
            maxlen=keys.JOB_COMMANDS_MAXLEN,
            approximate=True,
        )
        pipe.expire(stream, s.retention_seconds)
        if not broker.cluster:
            pipe.publish(keys.JOB_COMMANDS_QUEUED, stream)
        await pipe.execute()
    if broker.cluster:
        await broker.redis.publish(keys.JOB_COMMANDS_QUEUED, stream)
    return command


async def after(broker: Broker, stream: str, cursor: str) -> list[Entry]:
    """The stream's entries after ``cursor``, oldest first (MAX_PER_POLL at most).

    One XRANGE per (stream, cursor) in flight on this replica: the thousands of
    polls arriving at once mostly share one cursor (and those a job-wide command
    wakes get one reading from the replica's wake-ups)."""
    flights: dict[Any, asyncio.Future[list[Entry]]]
    flights = broker.caches.setdefault("job command reads", {})
    key = (stream, cursor)
    flight = flights.get(key)
    if flight is None:
        flight = flights[key] = asyncio.ensure_future(_read(broker, stream, cursor))
        flight.add_done_callback(lambda _: flights.pop(key, None))
    return await asyncio.shield(flight)  # a poll that goes away leaves the read to the others


async def _read(broker: Broker, stream: str, cursor: str) -> list[Entry]:
    entries = await broker.redis.xrange(stream, f"({cursor}", "+", count=MAX_PER_POLL)
    encoded: dict[tuple[str, str], Entry] = broker.caches.setdefault("job commands encoded", {})
    found = []
    for entry_id, fields in entries:
        entry = encoded.get((stream, entry_id))
        if entry is None:
            if len(encoded) >= ENCODED_KEPT:
                encoded.clear()
            entry = encoded[stream, entry_id] = Entry.decode(str(entry_id), fields[FIELD])
        found.append(entry)
    return found


async def acknowledge(broker: Broker, session: SessionOut, command_id: str) -> Command | None:
    """Move the session's cursor past the job command ``command_id``; the command, or
    None when it is not one the session has yet to acknowledge. The agent handles
    commands in order, so an acknowledgement also covers the job's earlier ones."""
    stream = stream_of(session)
    if stream is None:
        return None
    cursor = await broker.redis.hget(keys.session(session.id), keys.JOB_CURSOR_FIELD)
    if cursor is None:
        return None
    for entry_id, fields in await broker.redis.xrange(stream, f"({cursor}", "+", count=ACK_SCAN):
        command = JobCommand.model_validate_json(fields[FIELD])
        if command.id != command_id:
            continue
        moved = await broker.scripts.advance_job_cursor(
            keys=[keys.session(session.id)], args=[keys.JOB_CURSOR_FIELD, entry_id]
        )
        return command.to(session.id) if moved else None
    return None
