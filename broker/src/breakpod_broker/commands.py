"""Commands to agents: queued by admins, long-polled by the agent, acknowledged.

Delivery is at least once: a polled command moves to the session's
``delivered`` list and stays there until acknowledged, and every poll hands
out unacknowledged commands first. Each step is recorded as a ``command``
event. Any replica may queue and any replica may deliver: it is all Redis.

A job-wide command (``POST /v1/jobs/{job}/commands``) is stored once for the
job (joblog.py) and handed out by each session's poll next to its own
commands; it is recorded on a session when that session acknowledges it
(recording ``queued`` and ``delivered`` on each would cost O(sessions)).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from redis.exceptions import RedisError

from breakpod import protocol
from breakpod_broker import joblog, keys
from breakpod_broker.auth import Admin, Agent
from breakpod_broker.context import Broker, BrokerDep
from breakpod_broker.events import ingest
from breakpod_broker.models import (
    Ack,
    Command,
    CommandId,
    CommandIn,
    CommandList,
    EventIn,
    JobCommand,
    JobCommandIn,
    JobName,
    SessionId,
    SessionOut,
)
from breakpod_broker.sessions import owned, owned_from, visible
from breakpod_broker.tokens import Principal

router = APIRouter(tags=["commands"])
MAX_PER_POLL = 16
COMMANDS = protocol.commands_path("{session_id}")
LIVE_CHECK_CHUNK = 100  # a job's sessions read per round trip looking for a live one


@router.post(COMMANDS, response_model=Command, status_code=202)
async def send(session_id: SessionId, body: CommandIn, who: Admin, broker: BrokerDep) -> Command:
    """Queue a command for the session's agent (admin only)."""
    session = await visible(broker, who, session_id)
    if session.state in protocol.FINAL_STATES:
        raise HTTPException(
            409, f"session {session_id!r} has finished: nobody will receive {body.command!r}"
        )
    command = Command(
        **body.model_dump(),
        id=uuid.uuid4().hex[:16],
        session=session_id,
        created=time.time(),
        by=who.token_id,
    )
    # queued, then published: the wake-up never comes before the command (in a
    # Redis Cluster the two go to different nodes, so not one transaction)
    async with broker.redis.pipeline(transaction=not broker.cluster) as pipe:
        pipe.lpush(keys.commands(session_id), command.model_dump_json())
        pipe.expire(keys.commands(session_id), broker.settings.retention_seconds)
        if not broker.cluster:
            pipe.publish(keys.COMMANDS_QUEUED, session_id)
        await pipe.execute()
    if broker.cluster:
        await broker.redis.publish(keys.COMMANDS_QUEUED, session_id)
    await _record(broker, session, command, "queued")
    return command


@router.post(protocol.job_commands_path("{job}"), response_model=JobCommand, status_code=202)
async def send_to_job(
    job: JobName, body: JobCommandIn, who: Admin, broker: BrokerDep
) -> JobCommand:
    """One command for every session of the job in ``namespace`` (admin only): stored
    once; each session registered by now receives it once, with its own commands."""
    if not who.may_see(body.namespace) or not await _has_live_session(broker, job, body.namespace):
        raise HTTPException(
            404, f"no running job {job!r} in namespace {body.namespace!r}: nobody would receive it"
        )
    return await joblog.append(broker, job, body, who.token_id)


async def _has_live_session(broker: Broker, job: str, namespace: str | None) -> bool:
    """Whether a session of ``job`` in ``namespace`` is alive and not finished (the
    newest sessions first: usually the first one read answers)."""
    start = 0
    while True:
        ids = await broker.redis.zrevrange(
            keys.job_sessions(job), start, start + LIVE_CHECK_CHUNK - 1
        )
        async with broker.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(keys.session(session_id), "namespace", "state")
                pipe.exists(keys.alive(session_id))
            replies = await pipe.execute()
        for (ns, state), alive in zip(replies[::2], replies[1::2], strict=True):
            if alive and (ns or None) == namespace and state not in protocol.FINAL_STATES:
                return True
        if len(ids) < LIVE_CHECK_CHUNK:
            return False
        start += LIVE_CHECK_CHUNK


@router.get(COMMANDS, response_model=CommandList)
async def poll(
    session_id: SessionId,
    who: Agent,
    broker: BrokerDep,
    wait: Annotated[float, Query(ge=0, le=300, description="seconds to wait for a command")] = 20.0,
) -> Response:
    """Long-poll: unacknowledged commands at once, else wait up to ``wait`` seconds for new ones.

    Commands come oldest first, redelivered ones too; ``delivered`` is recorded
    once per command, when it first leaves the queue. Commands sent to the
    session's job follow its own, until acknowledged. (fastpath.py serves the
    common case of this route below FastAPI, with :func:`answer_poll`.)"""
    answer = await answer_poll(broker, who, session_id, wait)
    return Response(answer, media_type="application/json")


async def answer_poll(broker: Broker, who: Principal, session_id: str, wait: float) -> bytes:
    """The poll's answer, a CommandList's JSON; HTTPException as the route answers."""
    # two round trips before a poll waits (a job's thousands of polls arrive at once):
    # the session with what it has yet to acknowledge, then (in the first look)
    # its alive key with its queue
    async with broker.redis.pipeline(transaction=False) as pipe:  # one slot: the session's
        pipe.hgetall(keys.session(session_id))
        pipe.exists(keys.alive(session_id))
        pipe.lrange(keys.delivered(session_id), 0, MAX_PER_POLL - 1)
        fields, alive, pending = await pipe.execute()
    cursor = fields.get(keys.JOB_CURSOR_FIELD)
    session = owned_from(who, session_id, fields, alive)
    job = await _job_cursor(broker, session, cursor)
    if pending:
        await _touch(broker, session_id)
        own = [Command.model_validate_json(raw) for raw in pending]
        return _answer(session_id, own, await joblog.after(broker, *job) if job else [])
    wait = min(wait, broker.settings.max_poll_seconds)
    try:
        taken, for_job = await _take_when_queued(broker, session_id, wait, job)
    except RedisError as e:
        raise HTTPException(
            503, f"Redis unavailable ({type(e).__name__}): poll again", {"Retry-After": "1"}
        ) from None
    commands = [Command.model_validate_json(raw) for raw in taken]
    for command in commands:
        await _record(broker, session, command, "delivered")
    return _answer(session_id, commands, for_job)


def _answer(session_id: str, own: list[Command], for_job: list[joblog.Entry]) -> bytes:
    """The poll's CommandList as JSON, written by hand: a job command's JSON is encoded
    once per replica (joblog.Entry), not once per poll (a ``break`` to a job answers
    thousands of polls at once)."""
    parts = [c.model_dump_json().encode() for c in own]
    parts += [entry.json_for(session_id) for entry in for_job]
    return b'{"commands":[' + b",".join(parts) + b"]}"


JobCursor = tuple[str, str]  # (the job's command stream, the session's cursor in it)
Taken = tuple[list[str], list[joblog.Entry]]  # the session's own commands (JSON), its job's


async def _job_cursor(broker: Broker, session: SessionOut, cursor: str | None) -> JobCursor | None:
    """Where the session reads its job's commands; None without a job. A session
    registered by a broker without job commands starts its cursor now."""
    stream = joblog.stream_of(session)
    if stream is None:
        return None
    if cursor is None:
        newest = await joblog.last_id(broker, stream)
        cursor = await joblog.start_cursor(broker, session.id, stream, newest)
    return stream, cursor


async def _take_when_queued(
    broker: Broker, session_id: str, wait: float, job: JobCursor | None
) -> Taken:
    """Queued commands (and the job's unacknowledged ones) at once, else the first
    ones within ``wait`` seconds: woken by the replica's subscription (wakeups.py),
    taken with a plain LMOVE; the job's read once for all the polls it wakes. 503
    at once when the broker begins to shut down (the agent polls again; a command
    taken meanwhile stays in ``delivered`` and is handed out by the next poll)."""
    deadline = time.monotonic() + wait
    stream, cursor = job if job else (None, None)
    first = True
    # registered before the first look: no command is missed
    with broker.wakeups.waiter(session_id, stream, cursor) as woken:
        while True:
            if broker.wakeups.closing:
                raise HTTPException(
                    503, "the broker is shutting down: poll again", {"Retry-After": "1"}
                )
            own, for_job, found = woken.own, woken.job, woken.found
            woken.clear()  # a wake-up during this look makes the next wait return at once
            taken = await _take(broker, session_id, touch=first) if own else []
            first = False
            if job is None or not for_job:
                found = []
            elif found is None:  # not read for it by the replica's wake-ups: read now
                found = await joblog.after(broker, *job)
            left = deadline - time.monotonic()
            if taken or found or left <= 0:
                return taken, found
            await woken.wait(left)


async def _touch(broker: Broker, session_id: str) -> None:
    """A poll keeps its session alive, as a heartbeat does."""
    async with broker.redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.alive(session_id), "1", ex=broker.alive_ttl())
        pipe.zadd(keys.DEADLINES, {session_id: time.time() + broker.alive_ttl()})
        await pipe.execute()


async def _take(broker: Broker, session_id: str, touch: bool) -> list[str]:
    """Move up to MAX_PER_POLL commands, oldest first, from the queue's right end
    to the right end of ``delivered`` (which so stays oldest first); ``touch``: in
    the same round trip, keep the session alive (see _touch)."""
    src, dst = keys.commands(session_id), keys.delivered(session_id)
    async with broker.redis.pipeline(transaction=False) as pipe:  # and the deadlines (deaths.py)
        if touch:
            pipe.set(keys.alive(session_id), "1", ex=broker.alive_ttl())
            pipe.zadd(keys.DEADLINES, {session_id: time.time() + broker.alive_ttl()})
        pipe.lmove(src, dst, "RIGHT", "RIGHT")
        first = (await pipe.execute())[-1]
    if first is None:
        return []
    taken = [first]
    while len(taken) < MAX_PER_POLL and (
        more := await broker.redis.lmove(src, dst, "RIGHT", "RIGHT")
    ):
        taken.append(more)
    await broker.redis.expire(dst, broker.settings.retention_seconds)
    return taken


@router.post(protocol.ack_path("{session_id}", "{command_id}"), response_model=Command)
async def ack(
    session_id: SessionId,
    command_id: CommandId,
    body: Ack,
    who: Agent,
    broker: BrokerDep,
) -> Command:
    """The agent handled (``ok``) or could not handle a delivered command."""
    session = await owned(broker, who, session_id)
    for raw in await broker.redis.lrange(keys.delivered(session_id), 0, -1):
        command = Command.model_validate_json(raw)
        if command.id == command_id and await broker.redis.lrem(keys.delivered(session_id), 1, raw):
            done = protocol.COMMAND_DONE if body.ok else protocol.COMMAND_FAILED
            await _record(broker, session, command, done, body.detail)
            return command
    for_job = await joblog.acknowledge(broker, session, command_id)
    if for_job is not None:
        done = protocol.COMMAND_DONE if body.ok else protocol.COMMAND_FAILED
        await _record(broker, session, for_job, done, body.detail)
        return for_job
    raise HTTPException(
        404, f"command {command_id!r} is not awaiting acknowledgement on {session_id!r}"
    )


async def _record(
    broker: Broker, session: SessionOut, command: Command, state: str, detail: str | None = None
) -> None:
    fields = {
        "command": command.command,
        "command_id": command.id,
        "state": state,
        "reason": command.reason,
    }
    if detail is not None:
        fields["detail"] = detail
    event_id = f"cmd-{command.id}-{state}"
    await ingest(
        broker,
        [
            EventIn(
                id=event_id,
                session=session.id,
                kind=protocol.COMMAND_KIND,
                time=None,
                fields=fields,
            )
        ],
        {session.id: session},
    )
