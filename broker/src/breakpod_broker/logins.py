"""Dashboard logins: a token typed once into the page becomes an HttpOnly,
SameSite=Strict cookie naming a login kept in Redis, with a CSRF token that the
page sends back in a header on every state-changing request.

Redis keeps the SHA-256 of the cookie (a copy of Redis holds no usable cookie)
and the digest of the token the login stands for, so revoking that token ends
its logins at their next request. Logins live in Redis, so every replica knows
them; they expire after ``settings.login_seconds``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import secrets
import time

from breakpod_broker import keys
from breakpod_broker.context import Broker
from breakpod_broker.tokens import Principal, Role, digest

COOKIE = "breakpod_login"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # never change anything


@dataclasses.dataclass(frozen=True)
class Login:
    principal: Principal
    csrf: str
    expires: float

    def csrf_matches(self, sent: str | None) -> bool:
        return sent is not None and hmac.compare_digest(sent.encode(), self.csrf.encode())


class LoginRefused(Exception):
    """Why a token may not log in (the route answers with ``status``)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


async def create(broker: Broker, token: str) -> tuple[str, Login]:
    """A new login for ``token``: its cookie value and the login."""
    principal = await broker.tokens.lookup(token)
    if principal is None:
        raise LoginRefused(401, "unknown token")
    if principal.role is Role.agent:
        raise LoginRefused(403, "an agent token may not log in: use a viewer or admin token")
    cookie, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    seconds = broker.settings.login_seconds
    made = Login(principal, csrf, time.time() + seconds)
    record = {"token": digest(token), "csrf": csrf, "expires": made.expires}
    await broker.redis.set(keys.login(digest(cookie)), json.dumps(record), ex=seconds)
    return cookie, made


async def lookup(broker: Broker, cookie: str) -> Login | None:
    """The live login this cookie names; None when it expired, ended or its token was revoked."""
    if not cookie or len(cookie) > 128:
        return None
    raw = await broker.redis.get(keys.login(digest(cookie)))
    try:
        record = json.loads(raw) if raw is not None else None
        principal = await broker.tokens.by_digest(str(record["token"])) if record else None
    except (ValueError, TypeError, KeyError):
        return None  # not a record this broker wrote: no login
    if principal is None or record is None:
        return None
    return Login(principal, str(record["csrf"]), float(record["expires"]))


async def end(broker: Broker, cookie: str) -> None:
    await broker.redis.delete(keys.login(digest(cookie)))
