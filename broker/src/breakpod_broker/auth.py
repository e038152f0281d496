"""The FastAPI dependencies that check a request's bearer token and role.

Tokens themselves (parsing, hashing, lookup) are :mod:`.tokens`; the dashboard's
login cookie (and its CSRF token) stands in for a bearer token (:mod:`.logins`). Paths in
:data:`PUBLIC_PATHS` (the health checks) carry no bearer token, by design;
tests/broker/test_api.py checks that every other route needs one. The
admission webhook is not part of this app: it runs as its own app
(``breakpod_broker.admission:create_app``) served over TLS on its own port.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from breakpod_broker import logins
from breakpod_broker.context import Broker, BrokerDep
from breakpod_broker.tokens import Principal, Role

PUBLIC_PATHS = ("/healthz", "/readyz")

_bearer = HTTPBearer(auto_error=False, description="a breakpod broker token")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require(*roles: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency: 401 without a known token or login, 403 when its role is not in
    ``roles`` (or a login's state-changing request lacks its CSRF token)."""
    allowed = {*roles, Role.admin}

    async def check(request: Request, credentials: Credentials, broker: BrokerDep) -> Principal:
        if credentials is not None:
            found = await broker.tokens.lookup(credentials.credentials)
            if found is None:
                raise HTTPException(401, "unknown token", {"WWW-Authenticate": "Bearer"})
        else:
            found = await _logged_in(request, broker)
        if found.role not in allowed:
            names = ", ".join(sorted(r.value for r in allowed))
            role = found.role.value
            article = "an" if role[0] in "aeiou" else "a"
            raise HTTPException(403, f"{article} {role} token may not do this (needs: {names})")
        return found

    return check


async def _logged_in(request: Request, broker: Broker) -> Principal:
    """The dashboard's login cookie stands in for a bearer token; a request that
    changes something must also carry the login's CSRF token (another site's page
    can make the browser send the cookie, never read the token)."""
    cookie = request.cookies.get(logins.COOKIE)
    login = await logins.lookup(broker, cookie) if cookie else None
    if login is None:
        detail = "missing bearer token: send 'Authorization: Bearer TOKEN'"
        if cookie:
            detail = "the dashboard login has ended (expired, logged out or its token revoked)"
        raise HTTPException(401, detail, {"WWW-Authenticate": "Bearer"})
    if request.method not in logins.SAFE_METHODS and not login.csrf_matches(
        request.headers.get(logins.CSRF_HEADER)
    ):
        raise HTTPException(
            403, f"missing or wrong {logins.CSRF_HEADER} header: send the one the login returned"
        )
    return login.principal


def recheck(
    request: Request, credentials: HTTPAuthorizationCredentials | None, broker: Broker
) -> Callable[[], Awaitable[Principal | None]]:
    """How a long response (an SSE stream) asks again, later, whom the request's
    token or login stands for now (None once revoked, logged out or expired)."""
    if credentials is not None:
        token = credentials.credentials
        return lambda: broker.tokens.lookup(token)
    cookie = request.cookies.get(logins.COOKIE, "")

    async def login_principal() -> Principal | None:
        found = await logins.lookup(broker, cookie)
        return None if found is None else found.principal

    return login_principal


Agent = Annotated[Principal, Depends(require(Role.agent))]
Viewer = Annotated[Principal, Depends(require(Role.viewer))]
Admin = Annotated[Principal, Depends(require())]
