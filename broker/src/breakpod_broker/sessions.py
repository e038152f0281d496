"""Sessions: one per agent process. Registered, heartbeated, shown as lost when silent.

A session's hash outlives its heartbeats (retention), so a job that died
without a word is listed as ``lost`` instead of vanishing.
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ValidationError

from breakpod import protocol
from breakpod_broker import joblog, keys, sharded
from breakpod_broker.auth import Agent, Viewer
from breakpod_broker.context import Broker, BrokerDep
from breakpod_broker.models import Heartbeat, LiveSession, SessionId, SessionIn, SessionOut
from breakpod_broker.tokens import Principal

router = APIRouter(tags=["sessions"])
log = logging.getLogger(__name__)
SESSION = protocol.session_path("{session_id}")


@router.put(SESSION, response_model=LiveSession)
async def register(
    session_id: SessionId, body: SessionIn, who: Agent, broker: BrokerDep
) -> LiveSession:
    """Register (or re-register) a session; only its first registrant may update it."""
    if not who.may_see(body.namespace):
        raise HTTPException(
            403, f"this token may not register sessions in namespace {body.namespace!r}"
        )
    # the interval asked for and the alive key's TTL, read together (see beat)
    now, interval, ttl = time.time(), broker.heartbeat_seconds(), broker.alive_ttl()
    fields = {**_strings(body), "updated": str(now), "last_seen": str(now)}
    cleared = [k for k, v in body.model_dump().items() if v is None]
    s = broker.settings
    indexes = _indexes(body)
    # read before the session exists: a job command sent meanwhile reaches it
    job_stream = keys.job_commands(body.namespace or "", body.job) if body.job else None
    job_cursor = await joblog.last_id(broker, job_stream) if job_stream else None
    refused = await broker.scripts.register(
        keys=[
            keys.session(session_id),
            keys.alive(session_id),
            *([] if broker.cluster else indexes),
        ],
        args=[
            *(who.token_id, body.namespace or "", now, s.retention_seconds),
            *(ttl, session_id, len(cleared), *cleared),
            *(x for pair in fields.items() for x in pair),
        ],
    )
    if not refused.startswith("+"):
        await _refuse_registration(broker, who, session_id, refused)
    await broker.redis.zadd(keys.DEADLINES, {session_id: now + ttl})
    if broker.cluster:  # the indexes live in other slots: added after the script
        await sharded.add_to_indexes(broker.redis, session_id, float(refused[1:]), indexes)
    if job_stream is not None and job_cursor is not None:  # none of the job's earlier commands
        await joblog.start_cursor(broker, session_id, job_stream, job_cursor)
    session = await load(broker, session_id)
    return LiveSession(**session.model_dump(), heartbeat_seconds=interval)


@router.post(protocol.heartbeat_path("{session_id}"), response_model=LiveSession)
async def heartbeat(
    session_id: SessionId, body: Heartbeat, who: Agent, broker: BrokerDep
) -> LiveSession:
    """Keep a session alive (and optionally change its state): one Lua call.
    (fastpath.py serves the common case of this route below FastAPI, the same way.)"""
    reply, interval = await beat(broker, who, session_id, body)
    return _heartbeaten(who, session_id, reply, interval)


async def beat(
    broker: Broker, who: Principal, session_id: str, body: Heartbeat
) -> tuple[list[str], float]:
    """The heartbeat script's reply (written when ``ok``, else nothing written), and the
    interval to ask for: the one the alive key's TTL was set by, read together before the
    script (the session count behind both is recounted in the background meanwhile)."""
    s = broker.settings
    now, interval, ttl = time.time(), broker.heartbeat_seconds(), broker.alive_ttl()
    reply: list[str] = await broker.scripts.heartbeat(
        keys=[
            keys.session(session_id),
            keys.alive(session_id),
            *([] if broker.cluster else [keys.DEADLINES]),
        ],
        args=[
            *(who.token_id, now, s.retention_seconds, ttl, session_id),
            *(x for pair in _strings(body).items() for x in pair),
        ],
    )
    if broker.cluster and reply[0] == "ok":  # another slot: after the script
        await broker.redis.zadd(keys.DEADLINES, {session_id: now + ttl})
    return reply, interval


def heartbeat_session(session_id: str, reply: list[str], interval: float) -> LiveSession | None:
    """The session as the heartbeat script left it, with the interval to beat at;
    None when the script wrote nothing."""
    if reply[0] != "ok":
        return None
    session = _decode(session_id, dict(zip(reply[1::2], reply[2::2], strict=True)), 1)
    if session is None:
        return None
    return LiveSession(**session.model_dump(), heartbeat_seconds=interval)


def _heartbeaten(who: Principal, session_id: str, reply: list[str], interval: float) -> LiveSession:
    """The session as the heartbeat script left it; 404 or 403 as ``owned`` answers."""
    if reply[0] == "owner" and who.may_see(reply[1] or None):
        raise _not_owner(session_id)
    session = heartbeat_session(session_id, reply, interval)
    if session is None:
        raise HTTPException(
            404,
            f"no session {session_id!r}: an agent registers it with "
            f"PUT {protocol.session_path(session_id)}",
        )
    return session


@router.get(SESSION, response_model=SessionOut)
async def get_session(session_id: SessionId, who: Viewer, broker: BrokerDep) -> SessionOut:
    return await visible(broker, who, session_id)


async def visible(broker: Broker, who: Principal, session_id: str) -> SessionOut:
    """The session, if ``who``'s namespaces include it; 404 (not 403: no hint) otherwise."""
    session = await load(broker, session_id)
    if not who.may_see(session.namespace):
        raise HTTPException(404, f"no session {session_id!r}")
    return session


def _indexes(body: SessionIn) -> list[str]:
    """The listing indexes a session registered with ``body`` belongs to."""
    found = [keys.SESSIONS, keys.namespace_sessions(body.namespace or "")]
    return found + ([keys.job_sessions(body.job)] if body.job else [])


async def _refuse_registration(
    broker: Broker, who: Principal, session_id: str, refused: str
) -> None:
    """Why the script wrote nothing; 404, as for any session the token may not see,
    when the id is held in a namespace outside the token's (its owner and namespace
    are not for it to learn)."""
    registered = refused.partition(":")[2] if refused.startswith("namespace:") else None
    if refused == "owner":
        registered = await broker.redis.hget(keys.session(session_id), "namespace")
    if not who.may_see(registered or None):
        raise HTTPException(404, f"no session {session_id!r} here: register under another id")
    if refused == "owner":
        raise _not_owner(session_id)
    if refused.startswith("namespace:"):
        registered = refused.partition(":")[2] or None
        raise HTTPException(
            409,
            f"session {session_id!r} is registered in namespace {registered!r}: a session's "
            "namespace never changes; register under a new session id",
        )


def check_owner(who: Principal, session_id: str, owner: str | None) -> None:
    """403 unless ``who`` registered the session: only its owner writes to it, admins too."""
    if owner is not None and owner != who.token_id:
        raise _not_owner(session_id)


def _not_owner(session_id: str) -> HTTPException:
    return HTTPException(
        403,
        f"session {session_id!r} belongs to another token: only the token that "
        "registered it may write to it",
    )


async def owned(broker: Broker, who: Principal, session_id: str) -> SessionOut:
    """The session, if ``who`` may write to it; 404/403 otherwise."""
    session = await visible(broker, who, session_id)
    check_owner(who, session_id, session.owner)
    return session


def owned_from(who: Principal, session_id: str, fields: dict[str, str], alive: int) -> SessionOut:
    """``owned`` for a session hash the caller read itself (in a pipeline of its own)."""
    session = _decode(session_id, fields, alive)
    if session is None:
        raise _missing(session_id)
    if not who.may_see(session.namespace):
        raise HTTPException(404, f"no session {session_id!r}")
    check_owner(who, session_id, session.owner)
    return session


async def load(broker: Broker, session_id: str) -> SessionOut:
    session = await _read(broker, session_id)
    if session is None:
        raise _missing(session_id)
    return session


def _missing(session_id: str) -> HTTPException:
    return HTTPException(
        404,
        f"no session {session_id!r}: an agent registers it with "
        f"PUT {protocol.session_path(session_id)}",
    )


async def _read(broker: Broker, session_id: str) -> SessionOut | None:
    return (await read_many(broker, [session_id]))[0]


async def read_many(
    broker: Broker, session_ids: list[str], index: str = keys.SESSIONS
) -> list[SessionOut | None]:
    """Sessions by id in one round trip; ``None`` for those that expired (pruned
    from the index of all sessions and from ``index``, the one they were listed from)."""
    async with broker.redis.pipeline(transaction=False) as pipe:
        for session_id in session_ids:
            pipe.hgetall(keys.session(session_id))
            pipe.exists(keys.alive(session_id))
        replies = await pipe.execute()
    found = [
        _decode(i, f, a) for i, f, a in zip(session_ids, replies[::2], replies[1::2], strict=True)
    ]
    gone = [i for i, s in zip(session_ids, found, strict=True) if s is None]
    if gone:  # expired: prune the index
        for listed in {keys.SESSIONS, index}:
            if broker.cluster:
                await sharded.prune(broker.redis, gone, listed)
            else:
                await broker.scripts.prune(keys=[*map(keys.session, gone)], args=[*gone, listed])
    return found


def _decode(session_id: str, fields: dict[str, str], alive: int) -> SessionOut | None:
    if not fields:
        return None
    if not alive and fields.get("state") not in protocol.FINAL_STATES:
        was = fields.get("state") or protocol.INITIAL_STATE
        fields["state"] = protocol.LOST
        fields["reason"] = f"{protocol.LOST_REASON} (was {was})"
    data = {**fields, "id": session_id}
    try:
        return SessionOut.model_validate(data)
    except ValidationError as e:  # stored by an older, laxer broker: drop what is invalid
        bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        log.warning("session %s: dropping stored fields that fail validation: %s", session_id, bad)
    try:
        return SessionOut.model_validate({k: v for k, v in data.items() if k not in bad})
    except ValidationError as e:  # a required field is missing: not a session to show
        log.warning("session %s: stored hash is incomplete, skipped: %s", session_id, e)
        return None


def _strings(body: BaseModel) -> dict[str, str]:
    """The fields set in ``body``, as the strings a Redis hash holds."""
    return {k: str(v) for k, v in body.model_dump(exclude_none=True).items()}


async def counts_by_state(broker: Broker) -> dict[str, int]:
    """For /metrics: how many sessions are in each state."""
    counts: dict[str, int] = {}
    for session in await read_many(broker, await broker.redis.zrange(keys.SESSIONS, 0, -1)):
        if session is not None:
            counts[session.state] = counts.get(session.state, 0) + 1
    return counts
