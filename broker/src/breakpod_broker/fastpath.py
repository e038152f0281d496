"""The heartbeat's fast path: the common case served below FastAPI's routing.

A heartbeat is the broker's most frequent request (every session, every few
seconds). Profiled under bench/scale.py, the handler (one Lua call) was a
quarter of its time; routing, dependency solving and request/response
validation took most of the rest. This ASGI middleware serves the happy path
itself: a POST to a heartbeat path, a known agent (or admin) bearer token, a
valid body, a session the token owns. It does exactly what
``sessions.heartbeat`` does and answers the same JSON. Anything else (no or
unknown token, wrong role, invalid body, a missing or foreign session: the
script then wrote nothing) goes to the app unchanged, which answers with its
usual status and message.
"""

from __future__ import annotations

import re

from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from breakpod import protocol
from breakpod_broker.models import Heartbeat
from breakpod_broker.sessions import beat, heartbeat_session
from breakpod_broker.tokens import Role

PATH = re.compile("^" + protocol.heartbeat_path(f"({protocol.SESSION_ID_PATTERN[1:-1]})") + "$")
ALLOWED = {Role.agent, Role.admin}
MAX_BODY = 4096  # a heartbeat body is a few bytes; larger ones take the ordinary path


class HeartbeatFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, complete = await read_body(receive, MAX_BODY)
        small = complete and len(body) <= MAX_BODY
        answer = await _serve(scope, match.group(1), body) if small else None
        if answer is None:  # the ordinary path decides, and says why
            await self.app(scope, replay_body(body, complete, receive), send)
            return
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


async def _serve(scope: Scope, session_id: str, body: bytes) -> bytes | None:
    """The session's JSON after the heartbeat, or None when the app must answer."""
    token = _bearer(scope)
    broker = scope["app"].state.broker
    try:
        who = await broker.tokens.lookup(token) if token else None
    except RedisError:
        return None
    if who is None or who.role not in ALLOWED:
        return None
    try:
        heartbeat = Heartbeat.model_validate_json(body or b"{}")
    except ValidationError:
        return None
    try:
        reply = await beat(broker, who, session_id, heartbeat)
    except RedisError:  # the app tries again and answers 503 (a heartbeat may repeat)
        return None
    session = heartbeat_session(session_id, reply, broker.heartbeat_seconds())
    return None if session is None else session.model_dump_json().encode()


def _bearer(scope: Scope) -> str | None:
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
