"""The FastAPI dependencies that check a request's bearer token and role.

Tokens themselves (parsing, hashing, lookup) are :mod:`.tokens`. Paths in
:data:`PUBLIC_PATHS` (the health checks) carry no bearer token, by design;
tests/broker/test_api.py checks that every other route needs one. The
admission webhook is not part of this app: it runs as its own app
(``breakpod_broker.admission:create_app``) served over TLS on its own port.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from breakpod_broker.context import BrokerDep
from breakpod_broker.tokens import Principal, Role

PUBLIC_PATHS = ("/healthz", "/readyz")

_bearer = HTTPBearer(auto_error=False, description="a breakpod broker token")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require(*roles: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency: 401 without a known token, 403 when its role is not in ``roles``."""
    allowed = {*roles, Role.admin}

    async def check(credentials: Credentials, broker: BrokerDep) -> Principal:
        if credentials is None:
            raise HTTPException(
                401,
                "missing bearer token: send 'Authorization: Bearer TOKEN'",
                {"WWW-Authenticate": "Bearer"},
            )
        found = await broker.tokens.lookup(credentials.credentials)
        if found is None:
            raise HTTPException(401, "unknown token", {"WWW-Authenticate": "Bearer"})
        if found.role not in allowed:
            names = ", ".join(sorted(r.value for r in allowed))
            role = found.role.value
            article = "an" if role[0] in "aeiou" else "a"
            raise HTTPException(403, f"{article} {role} token may not do this (needs: {names})")
        return found

    return check


Agent = Annotated[Principal, Depends(require(Role.agent))]
Viewer = Annotated[Principal, Depends(require(Role.viewer))]
Admin = Annotated[Principal, Depends(require())]
