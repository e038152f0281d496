"""The dashboard: a live web page of the cluster's jobs, rank by rank, served at ``/``.

The page and its assets (``static/``: plain HTML, JS and CSS, no build step,
nothing from another host) carry no data and need no token: the page asks
for a viewer token, keeps it in sessionStorage, and sends it as a bearer
header to the ordinary API (sessions, events, attach) and to the SSE event
stream, which it reads with ``fetch`` (EventSource cannot send headers, and a
token in a URL would land in logs and history). No other route is added but
:data:`CONFIG`: what the page needs to read the API (the protocol's states and
the state each event kind moves a session to, the command paths and names, the
token's role), so the page spells none of them. The command buttons are drawn
for admin tokens only; the command API refuses any other token (403) whatever
a page shows, and a bearer header (never a cookie) is what makes a request
count, so another site cannot forge one.

Every response from here carries a strict Content-Security-Policy: scripts,
styles and connections from this origin only, no inline script, no framing.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from breakpod import protocol
from breakpod_broker.auth import Viewer

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
# Drawn first: the states of the kinds notifiers alert on (a stall, a park); the
# rest follow in protocol order, then states this broker does not know of.
URGENT = tuple(
    protocol.STATE_OF_KIND[k] for k in protocol.NOTIFIED_KINDS if k in protocol.STATE_OF_KIND
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
    states = [*URGENT, *(s for s in protocol.STATES if s not in URGENT), protocol.LOST]
    return {
        "states": states,
        "urgent": list(URGENT),
        "state_of_kind": protocol.STATE_OF_KIND,
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
        },
    }
