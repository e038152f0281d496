"""The heartbeat's and the command poll's fast paths: the common case served below
FastAPI's routing.

A heartbeat is the broker's most frequent request (every session, every few
seconds). Profiled under bench/scale.py, the handler (one Lua call) was a
quarter of its time; routing, dependency solving and request/response
validation took most of the rest. This ASGI middleware serves the happy path
itself: a POST to a heartbeat path, a known agent (or admin) bearer token, a
valid body, a session the token owns. It reads that body under the same deadline
as every other route (``body_seconds``, then 408): headers announcing a body that
never comes hold no connection. It does exactly what
``sessions.heartbeat`` does and answers the same JSON. Anything else (no or
unknown token, wrong role, invalid body, a missing or foreign session: the
script then wrote nothing) goes to the app unchanged, which answers with its
usual status and message.

A command long-poll (``PollFastPath``) is the other request that comes by the
thousand: a job-wide ``break`` answers every waiting poll of the job at once,
and what each answer costs after the wake-up is the ``break``'s latency. Served
here, an answer is two ASGI messages to the server; through FastAPI it was the
unwinding of its routing, dependencies, exception middleware and response
classes, about half of the broker's CPU per answer (profiled under
bench/scale.py). The fast path takes a known agent (or admin) bearer token and
a plain ``wait`` (or none), and then does exactly what the route does
(``commands.answer_poll``), answering its errors as FastAPI would (``{"detail":
...}``, the status and headers of the HTTPException). Anything else goes to
the app, which answers with its usual status and message.

Event ingest (``EventsFastPath``) is what an agent posts most after those: a
POST of one event cost ~0.9 ms of broker CPU, most of it FastAPI's
per-request path. It sits inside ``BodyLimit`` (the same 413 for a large body)
and takes a JSON body (``Content-Type: application/json``) from a known agent
(or admin) bearer token. The body is parsed (orjson; anything orjson refuses,
such as NaN, goes to the app) and validated as the route validates it
(``EventBatch.model_validate``, as FastAPI does, depth limit included); then it
runs the route's own ``events.accept`` and answers its errors (413 for too
many events, 404/403 for a session the token may not write, 422 for NaN or
oversized fields) as FastAPI would. An invalid body, any other token, content
type or method, and a Redis error (ingest is deduplicated by event id: the
app's second try stores nothing twice) go to the app.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable
from typing import Any

from fastapi import HTTPException
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from breakpod import protocol

try:
    from orjson import loads as _loads  # its JSONDecodeError is a ValueError
except ImportError:  # optional: json.loads then, as Starlette's request.json()
    from json import loads as _loads  # type: ignore[assignment]
from breakpod_broker.commands import answer_poll
from breakpod_broker.events import accept, plain_numbers
from breakpod_broker.fanout import within
from breakpod_broker.models import EventBatch, Heartbeat
from breakpod_broker.sessions import beat, heartbeat_session
from breakpod_broker.tokens import Principal, Role

SESSION = f"({protocol.SESSION_ID_PATTERN[1:-1]})"
PATH = re.compile("^" + protocol.heartbeat_path(SESSION) + "$")
POLL_PATH = re.compile("^" + protocol.commands_path(SESSION) + "$")
WAIT = re.compile(rb"^wait=([0-9]{1,3}(?:\.[0-9]{0,6})?)$")  # as the agent writes it (%g)
DEFAULT_WAIT = 20.0  # the route's default
MAX_WAIT = 300.0  # the route's bound
ALLOWED = {Role.agent, Role.admin}
MAX_BODY = 4096  # a heartbeat body is a few bytes; larger ones take the ordinary path
JSON = (b"content-type", b"application/json")


class _FastPath:
    """Serves its requests' common case below FastAPI's routing; ``app`` answers the rest."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app


class HeartbeatFastPath(_FastPath):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        seconds: float = scope["app"].state.broker.settings.body_seconds
        try:
            body, complete = await within(seconds, read_body(receive, MAX_BODY))
        except TimeoutError:
            await refuse(send, late_body(seconds))
            return
        small = complete and len(body) <= MAX_BODY
        answer = await _serve(scope, match.group(1), body) if small else None
        if answer is None:  # the ordinary path decides, and says why
            await self.app(scope, replay_body(body, complete, receive), send)
            return
        await _respond(send, 200, answer)


class PollFastPath(_FastPath):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = POLL_PATH.match(scope["path"]) if scope["type"] == "http" else None
        wait = _wait(scope["query_string"]) if match is not None else None
        mine = match is not None and wait is not None and scope["method"] == "GET"
        who = await _principal(scope) if mine else None
        if who is None or match is None or wait is None:
            await self.app(scope, receive, send)
            return
        answer = answer_poll(scope["app"].state.broker, who, match.group(1), wait)
        if not await _answered(send, answer):  # the app polls again and answers (503)
            await self.app(scope, receive, send)


class EventsFastPath(_FastPath):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        mine = (
            scope["type"] == "http"
            and scope["path"] == protocol.EVENTS
            and scope["method"] == "POST"
            and _json_body(scope)
        )
        if not mine:
            await self.app(scope, receive, send)
            return
        limit: int = scope["app"].state.broker.settings.max_body_bytes
        body, complete = await read_body(receive, limit)  # BodyLimit outside refused more
        batch = _batch(body) if complete else None
        who = await _principal(scope) if batch is not None else None  # after: no lookup twice
        if batch is None or who is None:  # the ordinary path decides, and says why
            await self.app(scope, replay_body(body, complete, receive), send)
            return
        answer = _accepted(scope["app"].state.broker, who, batch)
        if not await _answered(send, answer):  # the app tries again (deduplicated), answers
            await self.app(scope, replay_body(body, True, receive), send)


async def _accepted(broker: Any, who: Principal, batch: EventBatch) -> bytes:
    return (await accept(broker, who, batch, plain=True)).model_dump_json().encode()  # _batch


async def _answered(send: Send, answer: Awaitable[bytes]) -> bool:
    """Send the route's answer, or its HTTPException as FastAPI's handler would; False
    (nothing sent) on a Redis error, which the app then meets and answers itself."""
    try:
        body = await answer
    except HTTPException as e:
        await refuse(send, e)
        return True
    except RedisError:
        return False
    await _respond(send, 200, body)
    return True


def _json_body(scope: Scope) -> bool:
    """The body is declared as plain JSON (the agent's and httpx's header); other
    declarations, or none, are for the app to judge."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value == b"application/json")
    return False


def _batch(body: bytes) -> EventBatch | None:
    """The body as the route validates it (FastAPI: JSON, then ``validate_python``);
    None when the app must answer (not JSON to orjson, numbers orjson would not carry
    as the app does (see :func:`.events.plain_numbers`), or not a valid batch)."""
    if not plain_numbers(body):
        return None
    try:
        data = _loads(body)
    except (ValueError, RecursionError):
        return None
    try:
        return EventBatch.model_validate(data)
    except ValidationError:
        return None


async def refuse(send: Send, e: HTTPException) -> None:
    """An HTTPException as FastAPI's handler answers it."""
    detail = json.dumps({"detail": e.detail}, ensure_ascii=False, separators=(",", ":")).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await _respond(send, e.status_code, detail, extra)


def late_body(seconds: float) -> HTTPException:
    """The answer to a body not all received within ``seconds`` of its headers."""
    return HTTPException(408, f"the body did not arrive within {seconds:g}s")


def _wait(query: bytes) -> float | None:
    """The poll's ``wait``; None when the query is anything else (the app decides)."""
    if not query:
        return DEFAULT_WAIT
    found = WAIT.match(query)
    wait = float(found.group(1)) if found else None
    return wait if wait is not None and wait <= MAX_WAIT else None


async def _respond(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [JSON, (b"content-length", str(len(body)).encode()), *(extra or ())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _principal(scope: Scope) -> Principal | None:
    """The bearer token's principal when it may take a fast path; None otherwise."""
    token = bearer(scope)
    try:
        who: Principal | None = (
            await scope["app"].state.broker.tokens.lookup(token) if token else None
        )
    except RedisError:
        return None
    return who if who is not None and who.role in ALLOWED else None


async def _serve(scope: Scope, session_id: str, body: bytes) -> bytes | None:
    """The session's JSON after the heartbeat, or None when the app must answer."""
    who = await _principal(scope)
    if who is None:
        return None
    broker = scope["app"].state.broker
    try:
        heartbeat = Heartbeat.model_validate_json(body or b"{}")
    except ValidationError:
        return None
    try:
        reply, interval = await beat(broker, who, session_id, heartbeat)
    except RedisError:  # the app tries again and answers 503 (a heartbeat may repeat)
        return None
    session = heartbeat_session(session_id, reply, interval)
    return None if session is None else session.model_dump_json().encode()


def bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token if scheme.lower() == "bearer" and token else None
    return None


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body, and whether it is all there: reading stops once it is past ``limit``
    (the caller refuses it, or hands the rest on with :func:`replay_body`)."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:
            return body, not more
    return body, True


def replay_body(body: bytes, complete: bool, receive: Receive) -> Receive:
    """``receive`` for the app behind a middleware that already read ``body``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": not complete}

    return replay
