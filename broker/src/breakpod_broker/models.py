"""The broker's HTTP schemas, built from :mod:`breakpod.protocol` in one place.

Every event kind, state, command, runtime, listener, id pattern and name rule
below is the protocol's own (tests/test_architecture.py checks that no other
module spells them). Routers import these models; models import nothing of
the broker but tokens (roles) and limits.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import BaseModel, Field, field_validator

from breakpod import protocol
from breakpod.protocol import CommandName, EventKind, ListenerKind, Lost, Runtime, State
from breakpod_broker.limits import MAX_DEPTH, MAX_FIELDS_BYTES, dotted, too_deep
from breakpod_broker.tokens import Role

# -- names --------------------------------------------------------------------

# no ":" in ids: Redis keys join a session id and an event id with ":"
SessionId = Annotated[
    str, Path(pattern=protocol.SESSION_ID_PATTERN, description="session id chosen by the agent")
]
CommandId = Annotated[str, Path(pattern=protocol.COMMAND_ID_PATTERN)]
Name = Annotated[str | None, Field(max_length=protocol.DNS_SUBDOMAIN_MAX)]
# Kubernetes object names (they reach the engineer's kubectl): DNS-1123 label / subdomain
Label = Annotated[str | None, Field(pattern=protocol.DNS_LABEL_PATTERN, examples=["ml-team"])]
Subdomain = Annotated[
    str | None,
    Field(
        max_length=protocol.DNS_SUBDOMAIN_MAX,
        pattern=protocol.DNS_SUBDOMAIN_PATTERN,
        examples=["train-0"],
    ),
]
Address = Annotated[
    str | None, Field(pattern=protocol.ADDRESS_PATTERN, examples=["127.0.0.1:5678"])
]
Reason = Annotated[str | None, Field(max_length=2000)]

# -- sessions -----------------------------------------------------------------


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
    runtime: Runtime = protocol.DEFAULT_RUNTIME
    listener: ListenerKind | None = None
    address: Address = Field(
        default=None, description="listener HOST:PORT inside the process's network"
    )
    attach_address: Address = Field(
        default=None, description="HOST:PORT published for engineers, if any"
    )
    state: State = protocol.INITIAL_STATE
    reason: Reason = None
    cwd: str | None = Field(
        default=None, max_length=4096, description="the process's working directory"
    )


class Heartbeat(BaseModel):
    state: State | None = None
    reason: Reason = None
    # protocol.HEARTBEAT_STEP: the last training step, when the process counts them
    step: int | None = Field(None, ge=0, le=2**63 - 1)


class SessionOut(SessionIn):
    id: str
    state: State | Lost = protocol.INITIAL_STATE  # type: ignore[assignment]
    created: float
    updated: float
    last_seen: float
    owner: str = Field(description="id of the token that registered the session")
    since: float | None = Field(None, description="unix seconds: when the state began")
    hold_until: float | None = Field(
        None, description="parked: unix seconds until which it waits for a debugger"
    )
    attached_by: str | None = Field(None, description="attached: the debugger client's address")
    culprit: str | None = Field(
        None, description="stalled: the rank(s) the job waits for, where, from the job's report"
    )
    step: int | None = Field(
        None, ge=0, description="the last training step, as of the process's last heartbeat"
    )


class LiveSession(SessionOut):
    """A session as its agent sees it after registering or beating."""

    heartbeat_seconds: float = Field(
        description="beat again within this many seconds (it grows with the sessions the "
        "broker holds; a session silent for a few such intervals reads as lost)"
    )


class SessionList(BaseModel):
    sessions: list[SessionOut]


# -- events -------------------------------------------------------------------

MAX_BATCH = 10_000  # the schema's bound; settings.max_batch is the one applied


class EventIn(BaseModel):
    id: str = Field(
        pattern=protocol.EVENT_ID_PATTERN, description="chosen by the sender; retries reuse it"
    )
    session: str = Field(pattern=protocol.SESSION_ID_PATTERN)
    kind: EventKind
    time: float | None = Field(
        None, ge=0, le=1e11, description="unix seconds; default: when received"
    )
    fields: dict[str, Any] = Field(
        default_factory=dict,
        description=f"free-form JSON, at most {MAX_DEPTH} levels deep and "
        f'{MAX_FIELDS_BYTES} bytes; NaN and infinities as the strings "nan", "inf", "-inf"',
    )

    @field_validator("fields")
    @classmethod
    def _shallow(cls, fields: dict[str, Any]) -> dict[str, Any]:
        path = too_deep(fields)
        if path is not None:
            raise ValueError(
                f"fields nested more than {MAX_DEPTH} levels deep at fields.{dotted(path)}: "
                "flatten them"
            )
        return fields


class EventBatch(BaseModel):
    events: list[EventIn] = Field(min_length=1, max_length=MAX_BATCH)


class IngestResult(BaseModel):
    accepted: int
    duplicates: int
    cursors: list[str | None] = Field(description="stream id per event; null for a duplicate")


class EventOut(EventIn):
    cursor: str
    namespace: str | None = None
    received: float


class EventPage(BaseModel):
    events: list[EventOut]
    cursor: str | None = Field(description="pass as `since` to continue after the last event")


# -- commands -----------------------------------------------------------------


class CommandIn(BaseModel):
    command: CommandName
    reason: Reason = None


class Command(CommandIn):
    id: str
    session: str
    created: float
    by: str = Field(description="id of the token that sent it")
    job: str | None = Field(
        None, description="set on a job-wide command: every session of this job gets it once"
    )


# a job name as a path segment: anything a session's job may be, but for "/"
JobName = Annotated[
    str, Path(min_length=1, max_length=protocol.DNS_SUBDOMAIN_MAX, pattern=r"^[^/]+$")
]


class JobCommandIn(CommandIn):
    namespace: Label = Field(default=None, description="the job's namespace (none: no namespace)")


class JobCommand(CommandIn):
    """A job-wide command as stored once in the job's command stream."""

    id: str
    job: str
    namespace: str | None = None
    created: float
    by: str = Field(description="id of the token that sent it")

    def to(self, session_id: str) -> Command:
        """The command as one session of the job receives it."""
        return Command(
            command=self.command,
            reason=self.reason,
            id=self.id,
            session=session_id,
            created=self.created,
            by=self.by,
            job=self.job,
        )


class CommandList(BaseModel):
    commands: list[Command]


class Ack(BaseModel):
    ok: bool = True
    detail: Annotated[str | None, Field(max_length=10_000)] = None


# -- attach -------------------------------------------------------------------


class AttachInfo(BaseModel):
    session: str
    runtime: Runtime
    listener: ListenerKind
    state: str
    connect: str  # HOST:PORT to connect to, after port_forward when there is one
    port_forward: str | None = Field(None, description="for display: port_forward_argv, quoted")
    port_forward_argv: list[str] | None = Field(
        None, description="kubectl port-forward as an argv list: run it without a shell"
    )
    attach_command: str
    direct_command: str
    vscode_launch: dict[str, Any] | None = None
    cwd: str | None = None  # the session's working directory: the launch.json's remoteRoot


# -- tokens and operations ----------------------------------------------------

Namespace = Annotated[str, Field(min_length=1, max_length=protocol.DNS_SUBDOMAIN_MAX)]


class TokenIn(BaseModel):
    role: Role
    name: Annotated[str, Field(max_length=128)] = ""
    namespaces: Annotated[list[Namespace] | None, Field(max_length=100)] = None


class TokenInfo(BaseModel):
    id: str
    role: Role
    name: str
    namespaces: list[str] | None


class NewToken(TokenInfo):
    token: str = Field(description="shown once; the broker keeps only its SHA-256")


class NotifierStatus(BaseModel):
    name: str
    format: str
    kinds: list[str]
    policy: str = Field(default="", description="when an undelivered job becomes a dead letter")
    recent_failures: list[dict[str, str]] = Field(description="dead letters, newest first")


class LoginIn(BaseModel):
    """The dashboard's login form: a viewer or admin token, typed once."""

    token: str = Field(min_length=1, max_length=1024)


class LoginInfo(BaseModel):
    """A dashboard login: who it is, and the CSRF token its state-changing requests send
    back (the cookie itself is HttpOnly: the page never sees it)."""

    role: Role
    namespaces: list[str] | None
    csrf: str
    expires: float  # seconds since the epoch


class Status(BaseModel):
    """A health check's answer."""

    status: str
