"""The dashboard: a live web page of the cluster's jobs, rank by rank, served at ``/``.

The page and its assets (``static/``: plain HTML, JS and CSS, no build step,
nothing from another host) carry no data and need no token. The page's login
form posts a viewer or admin token once to :data:`protocol.LOGIN`, which answers
with an HttpOnly, SameSite=Strict cookie (:mod:`.logins`: the token never lands
in the page's storage, a URL or a log) and a CSRF token the page keeps in
memory and sends back in a header with every state-changing request; reloading
the page asks ``GET`` :data:`protocol.LOGIN` for it again. The cookie then
opens the ordinary API (sessions, events, attach, commands) and the SSE event
stream. :data:`CONFIG` is what the page needs to read the API (the protocol's
states and the state each event kind moves a session to, the command paths and
names, the role), so the page spells none of them. The command buttons are
drawn for admin logins only; the command API refuses any other (403) whatever a
page shows.

Every response from here carries a strict Content-Security-Policy: scripts,
styles and connections from this origin only, no inline script, no framing.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from breakpod import protocol
from breakpod_broker import logins
from breakpod_broker.auth import Viewer
from breakpod_broker.context import BrokerDep
from breakpod_broker.models import LoginIn, LoginInfo

router = APIRouter(tags=["dashboard"])
CONFIG = f"{protocol.API}/dashboard"
ASSETS = "/dashboard"

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The only files served: a fixed list, so no request path ever reaches the file system.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
    "detail.js": "text/javascript; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Drawn first, in this order: what burns time now (a stall, a park waiting for a
# debugger), then the processes that died (the runtime's kill, a non-zero exit, silence);
# the rest follow in protocol order, then states this broker does not know of.
URGENT = (
    protocol.STATE_OF_KIND[protocol.STALL],
    protocol.STATE_OF_KIND[protocol.PARKED],
    protocol.KILLED_STATE,
    protocol.FAILED,
    protocol.LOST,
)


@router.get("/", include_in_schema=False)
async def page() -> Response:
    """The page itself: a shell with no data in it."""
    return _asset("index.html")


@router.get(ASSETS + "/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in FILES:
        raise HTTPException(404, f"no dashboard file {name!r}")
    return _asset(name)


def _asset(name: str) -> Response:
    body = resources.files("breakpod_broker").joinpath("static", name).read_bytes()
    return Response(body, media_type=FILES[name], headers=SECURITY_HEADERS)


@router.get(CONFIG)
async def config(who: Viewer) -> dict[str, Any]:
    """What the page needs to read sessions and events; a viewer token is needed."""
    states = [*URGENT, *(s for s in protocol.STATES if s not in URGENT)]
    return {
        "states": states,
        "urgent": list(URGENT),
        # a lost event marks the session lost at once (the broker computes the state)
        "state_of_kind": {**protocol.STATE_OF_KIND, protocol.LOST_KIND: protocol.LOST},
        "final_states": sorted(protocol.FINAL_STATES),
        "event_kinds": sorted(protocol.EVENT_KINDS),
        "listener_kinds": sorted(protocol.LISTENER_KINDS),
        "commands": [protocol.BREAK, protocol.RESUME, protocol.DUMP_STACKS, protocol.DUMP_FLIGHT],
        "role": who.role.value,
        "paths": {
            "sessions": protocol.SESSIONS,
            "events": protocol.EVENTS,
            "stream": protocol.EVENTS_STREAM,
            "attach": protocol.attach_path("{id}"),
            "commands": protocol.commands_path("{id}"),
            "job_commands": protocol.job_commands_path("{job}"),
        },
    }


@router.post(protocol.LOGIN, response_model=LoginInfo, tags=["dashboard"])
async def login(
    body: LoginIn, request: Request, response: Response, broker: BrokerDep
) -> LoginInfo:
    """Log in with a viewer or admin token: an HttpOnly session cookie, and the CSRF
    token the page sends back in ``X-CSRF-Token``."""
    try:
        cookie, made = await logins.create(broker, body.token)
    except logins.LoginRefused as e:
        raise HTTPException(e.status, str(e)) from None
    response.set_cookie(
        logins.COOKIE,
        cookie,
        max_age=broker.settings.login_seconds,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return _login_info(made)


@router.get(protocol.LOGIN, response_model=LoginInfo, tags=["dashboard"])
async def current_login(request: Request, broker: BrokerDep) -> LoginInfo:
    """The page's login after a reload (its CSRF token again); 401 when there is none."""
    found = await logins.lookup(broker, request.cookies.get(logins.COOKIE, ""))
    if found is None:
        raise HTTPException(401, "not logged in", {"WWW-Authenticate": "Bearer"})
    return _login_info(found)


@router.post(protocol.LOGOUT, status_code=204, tags=["dashboard"])
async def logout(who: Viewer, request: Request, broker: BrokerDep) -> Response:
    """End the login (with its CSRF token) and forget the cookie; the token itself lives on."""
    cookie = request.cookies.get(logins.COOKIE)
    if cookie:
        await logins.end(broker, cookie)
    response = Response(status_code=204)
    response.delete_cookie(logins.COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _login_info(found: logins.Login) -> LoginInfo:
    ns = found.principal.namespaces
    return LoginInfo(
        role=found.principal.role,
        namespaces=None if ns is None else sorted(ns),
        csrf=found.csrf,
        expires=found.expires,
    )
