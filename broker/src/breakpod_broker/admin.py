"""Admin and operator endpoints: token management, notifier status, metrics, health."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Request, Response
from fastapi.openapi.utils import get_openapi

from breakpod import protocol
from breakpod_broker import keys, sessions
from breakpod_broker.auth import Admin, Viewer, require
from breakpod_broker.context import BrokerDep, healthz
from breakpod_broker.models import NewToken, NotifierStatus, Status, TokenIn, TokenInfo
from breakpod_broker.tokens import Principal, Role

router = APIRouter()


def _info(p: Principal) -> TokenInfo:
    ns = sorted(p.namespaces) if p.namespaces is not None else None
    return TokenInfo(id=p.token_id, role=p.role, name=p.name, namespaces=ns)


@router.get(protocol.WHOAMI, response_model=TokenInfo, tags=["admin"])
async def whoami(who: Annotated[Principal, Depends(require(Role.agent, Role.viewer))]) -> TokenInfo:
    """The caller's role: any valid token may ask (``breakpod doctor`` checks tokens here)."""
    return _info(who)


@router.post(protocol.TOKENS, response_model=NewToken, status_code=201, tags=["admin"])
async def create_token(body: TokenIn, who: Admin, broker: BrokerDep) -> NewToken:
    """A new token; a namespace-limited admin may only make tokens within its namespaces."""
    if not _within(who, body.namespaces):
        mine = ", ".join(sorted(who.namespaces or ()))
        raise HTTPException(
            403, f"this token is limited to namespaces [{mine}]: list a subset in 'namespaces'"
        )
    token, made = await broker.tokens.create(body.role, body.name, body.namespaces)
    return NewToken(**_info(made).model_dump(), token=token)


@router.get(protocol.TOKENS, response_model=list[TokenInfo], tags=["admin"])
async def list_tokens(who: Admin, broker: BrokerDep) -> list[TokenInfo]:
    """Tokens the caller could have made: all of them, or for a namespace-limited
    admin those limited to its namespaces."""
    return [_info(p) for p in await broker.tokens.list() if _within(who, p.namespaces)]


@router.delete(protocol.token_path("{token_id}"), status_code=204, tags=["admin"])
async def delete_token(
    token_id: Annotated[str, Path(pattern=r"^[0-9a-f]{12}$")], who: Admin, broker: BrokerDep
) -> Response:
    """Revoke a token made through the API (static tokens live in settings)."""
    stored = {p.token_id: p for p in await broker.tokens.list()}
    found = stored.get(token_id)
    if (
        found is None
        or not _within(who, found.namespaces)
        or not await broker.tokens.delete(token_id)
    ):
        raise HTTPException(
            404, f"no API-made token {token_id!r} (static tokens are changed in settings)"
        )
    return Response(status_code=204)


def _within(who: Principal, namespaces: Iterable[str] | None) -> bool:
    """Whether ``namespaces`` (None: all) lie within the caller's."""
    if who.namespaces is None:
        return True
    return namespaces is not None and set(namespaces) <= who.namespaces


@router.get(protocol.NOTIFIERS, response_model=list[NotifierStatus], tags=["admin"])
async def notifier_status(who: Viewer, broker: BrokerDep) -> list[NotifierStatus]:
    """Configured notifiers and their recent delivery failures (all replicas)."""
    failures = [
        f
        for _, f in await broker.redis.xrevrange(keys.NOTIFIER_FAILURES, count=200)
        if who.may_see(f.get("namespace") or None)
    ]
    return [
        NotifierStatus(
            name=n.name,
            format=n.format,
            kinds=list(n.kinds),
            policy=broker.notifiers.policy(n),
            recent_failures=[f for f in failures if f.get("notifier") == n.name][:20],
        )
        for n in broker.notifiers.notifiers
    ]


@router.get("/metrics", tags=["operations"], response_class=Response)
async def metrics(who: Viewer, broker: BrokerDep) -> Response:
    """Prometheus text format (counts across namespaces: an unrestricted token only)."""
    if who.namespaces is not None:
        raise HTTPException(403, "metrics span every namespace: scrape with an unrestricted token")
    await broker.metrics.ping(broker.redis)
    counts = await broker.metrics.session_counts(
        lambda: sessions.counts_by_state(broker), broker.settings.metrics_cache_seconds
    )
    body = broker.metrics.render(counts)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/openapi.json", include_in_schema=False)
async def openapi(who: Viewer, request: Request) -> dict[str, Any]:
    """The OpenAPI schema (viewer token)."""
    app: FastAPI = request.app
    return get_openapi(title=app.title, version=app.version, routes=app.routes)


@router.get("/healthz", tags=["operations"], response_model=Status)
async def broker_healthz(broker: BrokerDep, response: Response) -> Status:
    """The process is up and, without a Redis URL, so is its embedded redis-server
    (no token needed; 503 while the supervisor restarts a server that died)."""
    embedded = broker.embedded
    if embedded is not None and not embedded.running:
        response.status_code = 503
        return Status(status=f"embedded redis-server down (restarts: {embedded.restarts})")
    return Status.model_validate(await healthz())


@router.get("/readyz", tags=["operations"], response_model=Status)
async def readyz(broker: BrokerDep, response: Response) -> Status:
    """Redis answers (no token needed)."""
    try:
        await broker.metrics.ping(broker.redis)
    except Exception as e:  # any Redis failure means: not ready
        response.status_code = 503
        return Status(status=f"redis unavailable: {type(e).__name__}")
    return Status(status="ready")
