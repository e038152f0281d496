"""Sessions: one per agent process. Registered, heartbeated, shown as lost when silent.

A session's hash outlives its heartbeats (retention), so a job that died
without a word is listed as ``lost`` instead of vanishing.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import BaseModel, Field

from breakpod_broker import keys
from breakpod_broker.auth import Agent, Principal, Role, Viewer
from breakpod_broker.context import Broker, get_broker

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
SessionId = Annotated[str, Path(pattern=ID_PATTERN, description="session id chosen by the agent")]
State = Literal["running", "parked", "attached", "stalled", "finished"]
ADDRESS_PATTERN = r"^\[?[A-Za-z0-9._:-]{1,200}\]?:\d{1,5}$"
Name = Annotated[str | None, Field(max_length=253)]
Address = Annotated[str | None, Field(pattern=ADDRESS_PATTERN, examples=["127.0.0.1:5678"])]

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
BrokerDep = Annotated[Broker, Depends(get_broker)]


class SessionIn(BaseModel):
    """What an agent says about itself when it registers."""

    job: Name = None
    pod: Name = None
    namespace: Name = None
    node: Name = None
    container: Name = None
    host: Name = None
    pid: int | None = Field(default=None, ge=0, le=2**31)
    rank: int | None = Field(default=None, ge=0, le=1 << 20)
    world_size: int | None = Field(default=None, ge=0, le=1 << 20)
    local_rank: int | None = Field(default=None, ge=0, le=1 << 20)
    gpu: Name = None
    runtime: Literal["kubernetes", "compose", "docker", "local"] = "local"
    listener: Literal["pdb", "debugpy"] | None = None
    address: Address = Field(
        default=None, description="listener HOST:PORT inside the process's network"
    )
    attach_address: Address = Field(
        default=None, description="HOST:PORT published for engineers, if any"
    )
    state: State = "running"
    reason: Annotated[str | None, Field(max_length=2000)] = None


class Heartbeat(BaseModel):
    state: State | None = None
    reason: Annotated[str | None, Field(max_length=2000)] = None


class SessionOut(SessionIn):
    id: str
    state: State | Literal["lost"] = "running"  # type: ignore[assignment]
    created: float
    updated: float
    last_seen: float
    owner: str = Field(description="id of the token that registered the session")


class SessionList(BaseModel):
    sessions: list[SessionOut]


@router.put("/{session_id}", response_model=SessionOut)
async def register(
    session_id: SessionId, body: SessionIn, who: Agent, broker: BrokerDep
) -> SessionOut:
    """Register (or re-register) a session; only its first registrant may update it."""
    if not who.may_see(body.namespace):
        raise HTTPException(
            403, f"this token may not register sessions in namespace {body.namespace!r}"
        )
    existing = await broker.redis.hget(keys.session(session_id), "owner")
    check_owner(who, session_id, existing)
    now = time.time()
    fields = {k: str(v) for k, v in body.model_dump(exclude_none=True).items()}
    fields.update(updated=str(now), last_seen=str(now), owner=existing or who.token_id)
    async with broker.redis.pipeline(transaction=True) as pipe:
        pipe.hsetnx(keys.session(session_id), "created", str(now))
        pipe.hdel(keys.session(session_id), *_cleared(body))
        pipe.hset(keys.session(session_id), mapping=fields)
        _touch(pipe, broker, session_id, now)
        await pipe.execute()
    return await load(broker, session_id)


@router.post("/{session_id}/heartbeat", response_model=SessionOut)
async def heartbeat(
    session_id: SessionId, body: Heartbeat, who: Agent, broker: BrokerDep
) -> SessionOut:
    """Keep a session alive (and optionally change its state)."""
    await owned(broker, who, session_id)
    now = time.time()
    fields = {k: str(v) for k, v in body.model_dump(exclude_none=True).items()}
    async with broker.redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.session(session_id), mapping={**fields, "last_seen": str(now)})
        _touch(pipe, broker, session_id, now)
        await pipe.execute()
    return await load(broker, session_id)


@router.get("", response_model=SessionList)
async def list_sessions(
    who: Viewer, broker: BrokerDep, state: Annotated[str | None, Query(max_length=32)] = None
) -> SessionList:
    """Every known session, newest first; ``state`` filters (``lost`` included)."""
    ids = await broker.redis.zrevrange(keys.SESSIONS, 0, 999)
    found = [s for s in await read_many(broker, ids) if s is not None]
    visible = [s for s in found if who.may_see(s.namespace) and state in (None, s.state)]
    return SessionList(sessions=visible)


@router.get("/{session_id}", response_model=SessionOut)
async def get_session(session_id: SessionId, who: Viewer, broker: BrokerDep) -> SessionOut:
    session = await load(broker, session_id)
    if not who.may_see(session.namespace):
        raise HTTPException(404, f"no session {session_id!r}")
    return session


def check_owner(who: Principal, session_id: str, owner: str | None) -> None:
    if who.role is Role.agent and owner is not None and owner != who.token_id:
        raise HTTPException(403, f"session {session_id!r} belongs to another agent token")


async def owned(broker: Broker, who: Principal, session_id: str) -> SessionOut:
    """The session, if ``who`` may write to it; 404/403 otherwise."""
    session = await load(broker, session_id)
    check_owner(who, session_id, session.owner)
    return session


async def load(broker: Broker, session_id: str) -> SessionOut:
    session = await _read(broker, session_id)
    if session is None:
        raise HTTPException(
            404,
            f"no session {session_id!r}: an agent registers it with PUT /v1/sessions/{session_id}",
        )
    return session


async def _read(broker: Broker, session_id: str) -> SessionOut | None:
    return (await read_many(broker, [session_id]))[0]


async def read_many(broker: Broker, session_ids: list[str]) -> list[SessionOut | None]:
    """Sessions by id in one round trip; ``None`` for those that expired."""
    async with broker.redis.pipeline(transaction=False) as pipe:
        for session_id in session_ids:
            pipe.hgetall(keys.session(session_id))
            pipe.exists(keys.alive(session_id))
        replies = await pipe.execute()
    found = [
        _decode(i, f, a) for i, f, a in zip(session_ids, replies[::2], replies[1::2], strict=True)
    ]
    gone = [i for i, s in zip(session_ids, found, strict=True) if s is None]
    if gone:
        await broker.redis.zrem(keys.SESSIONS, *gone)  # expired: prune the index
    return found


def _decode(session_id: str, fields: dict[str, str], alive: int) -> SessionOut | None:
    if not fields:
        return None
    if not alive and fields.get("state") != "finished":
        fields["state"] = "lost"
    return SessionOut.model_validate({**fields, "id": session_id})


def _touch(pipe: Any, broker: Broker, session_id: str, now: float) -> None:
    s = broker.settings
    pipe.expire(keys.session(session_id), s.retention_seconds)
    pipe.set(keys.alive(session_id), "1", ex=s.heartbeat_ttl_seconds)
    pipe.zadd(keys.SESSIONS, {session_id: now})


def _cleared(body: SessionIn) -> list[str]:
    """Fields a re-registration leaves unset are removed, not kept stale."""
    return [k for k, v in body.model_dump().items() if v is None] or ["-"]


async def counts_by_state(broker: Broker) -> dict[str, int]:
    """For /metrics: how many sessions are in each state."""
    counts: dict[str, int] = {}
    for session in await read_many(broker, await broker.redis.zrange(keys.SESSIONS, 0, -1)):
        if session is not None:
            counts[session.state] = counts.get(session.state, 0) + 1
    return counts
