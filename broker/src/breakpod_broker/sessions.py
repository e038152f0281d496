"""Sessions: one per agent process. Registered, heartbeated, shown as lost when silent.

A session's hash outlives its heartbeats (retention), so a job that died
without a word is listed as ``lost`` instead of vanishing.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, Field, ValidationError

from breakpod_broker import keys
from breakpod_broker.auth import Agent, Principal, Viewer
from breakpod_broker.context import Broker, BrokerDep

# no ":" in ids: Redis keys join a session id and an event id with ":"
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SessionId = Annotated[str, Path(pattern=ID_PATTERN, description="session id chosen by the agent")]
State = Literal["running", "parked", "attached", "stalled", "finished"]
ADDRESS_PATTERN = r"^\[?[A-Za-z0-9._:-]{1,200}\]?:\d{1,5}$"
# Kubernetes object names (they reach the engineer's kubectl): DNS-1123 label / subdomain
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
Name = Annotated[str | None, Field(max_length=253)]
Label = Annotated[str | None, Field(pattern=DNS_LABEL, examples=["ml-team"])]
Subdomain = Annotated[
    str | None, Field(max_length=253, pattern=DNS_SUBDOMAIN, examples=["train-0"])
]
Address = Annotated[str | None, Field(pattern=ADDRESS_PATTERN, examples=["127.0.0.1:5678"])]

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
log = logging.getLogger(__name__)

# KEYS: session hash, alive key, session index. ARGV: token id, namespace ("" for
# none), now, retention, heartbeat ttl, session id, n fields to clear, the n
# names, then field/value pairs. Returns "" when written, else (nothing written)
# "owner" when another token registered the session, or "namespace:NS" when it
# was registered in another namespace NS. Owner and namespace never change once
# set, whoever asks; one script, so two registrants of one new id get one owner.
REGISTER_LUA = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return 'owner' end
if owner then
  local ns = redis.call('HGET', KEYS[1], 'namespace') or ''
  if ns ~= ARGV[2] then return 'namespace:' .. ns end
end
local n = tonumber(ARGV[7])
redis.call('HSETNX', KEYS[1], 'created', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
if n > 0 then redis.call('HDEL', KEYS[1], unpack(ARGV, 8, 7 + n)) end
if #ARGV > 7 + n then redis.call('HSET', KEYS[1], unpack(ARGV, 8 + n)) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[6])
return ''
"""

# KEYS: session hashes. ARGV: their ids. Drops from the index only ids whose
# hash is still gone (another replica may have re-registered one meanwhile).
PRUNE_LUA = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then redis.call('ZREM', ARGV[#ARGV], ARGV[i]) end
end
return 0
"""


class SessionIn(BaseModel):
    """What an agent says about itself when it registers."""

    job: Name = None
    pod: Subdomain = None
    namespace: Label = None
    node: Subdomain = None
    container: Label = None
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
    now = time.time()
    fields = {**_strings(body), "updated": str(now), "last_seen": str(now)}
    cleared = [k for k, v in body.model_dump().items() if v is None]
    s = broker.settings
    refused = await broker.redis.eval(
        REGISTER_LUA,
        3,
        keys.session(session_id),
        keys.alive(session_id),
        keys.SESSIONS,
        *(who.token_id, body.namespace or "", now, s.retention_seconds),
        *(s.heartbeat_ttl_seconds, session_id, len(cleared), *cleared),
        *(x for pair in fields.items() for x in pair),
    )
    _refuse_registration(session_id, refused)
    return await load(broker, session_id)


@router.post("/{session_id}/heartbeat", response_model=SessionOut)
async def heartbeat(
    session_id: SessionId, body: Heartbeat, who: Agent, broker: BrokerDep
) -> SessionOut:
    """Keep a session alive (and optionally change its state)."""
    await owned(broker, who, session_id)
    now = time.time()
    async with broker.redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.session(session_id), mapping={**_strings(body), "last_seen": str(now)})
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
    return await visible(broker, who, session_id)


async def visible(broker: Broker, who: Principal, session_id: str) -> SessionOut:
    """The session, if ``who``'s namespaces include it; 404 (not 403: no hint) otherwise."""
    session = await load(broker, session_id)
    if not who.may_see(session.namespace):
        raise HTTPException(404, f"no session {session_id!r}")
    return session


def _refuse_registration(session_id: str, refused: str) -> None:
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
    if gone:  # expired: prune the index
        await broker.redis.eval(
            PRUNE_LUA, len(gone), *map(keys.session, gone), *gone, keys.SESSIONS
        )
    return found


def _decode(session_id: str, fields: dict[str, str], alive: int) -> SessionOut | None:
    if not fields:
        return None
    if not alive and fields.get("state") != "finished":
        fields["state"] = "lost"
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


def _touch(pipe: Any, broker: Broker, session_id: str, now: float) -> None:
    s = broker.settings
    pipe.expire(keys.session(session_id), s.retention_seconds)
    pipe.set(keys.alive(session_id), "1", ex=s.heartbeat_ttl_seconds)
    pipe.zadd(keys.SESSIONS, {session_id: now})


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
