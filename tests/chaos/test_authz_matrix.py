"""Every role x namespace x route against a real broker: the table is the spec.

Two sessions, ``sa`` in team-a and ``sb`` in team-b, both registered by the
``agent`` token (with a listener address, a queued and a delivered command).
A cell ``X/Y`` is the status for sa / sb (one number: both); ``200+`` means the
session is listed, ``200-`` answered but not listed. On the token routes, sa/sb
stand for a token limited to team-a / team-b. Nobody but the registering token
writes to a session, and nobody moves it to another namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.brokerkit import ADMIN, AGENT, AGENT2, VIEWER, post_events, register

NAMESPACE = {"sa": "team-a", "sb": "team-b"}
PRINCIPALS = [
    *("none", "unknown", "agent", "agent2", "agent-a"),
    *("viewer", "viewer-a", "admin", "admin-a"),
]
MATRIX = """
route          none unknown agent   agent2 agent-a viewer viewer-a admin   admin-a
re-register    401  401     200     403    403     403    403      403     403
move-to-c      401  401     409     403    403     403    403      403     403
move-to-a      401  401     200/409 403    403/404 403    403      403     403/404
heartbeat      401  401     200     403    403/404 403    403      403     403/404
get            401  401     403     403    403     200    200/404  200     200/404
list           401  401     403     403    403     200+   200+/200- 200+   200+/200-
attach         401  401     403     403    403     200    200/404  200     200/404
post-event     401  401     200     403    403/404 403    403      403     403/404
read-events    401  401     403     403    403     200+   200+/200- 200+   200+/200-
stream         401  401     403     403    403     200    200      200     200
send-command   401  401     403     403    403     403    403      202     202/404
job-command    401  401     403     403    403     403    403      202     202/404
poll           401  401     200     403    403/404 403    403      403     403/404
ack            401  401     200     403    403/404 403    403      403     403/404
make-token     401  401     403     403    403     403    403      201     201/403
list-tokens    401  401     403     403    403     403    403      200     200
delete-token   401  401     403     403    403     403    403      204     204/404
whoami         401  401     200     200    200     200    200      200     200
dashboard      401  401     403     403    403     200    200      200     200
login          401  401     403     403    403     200    200      200     200
login-state    401  401     401     401    401     401    401      401     401
logout         401  401     403     403    403     204    204      204     204
notifiers      401  401     403     403    403     200    200      200     200
metrics        401  401     403     403    403     200    403      200     403
openapi        401  401     403     403    403     200    200      200     200
healthz        200  200     200     200    200     200    200      200     200
readyz         200  200     200     200    200     200    200      200     200
"""


def _rows() -> dict[str, dict[str, list[str]]]:
    lines = [line.split() for line in MATRIX.strip().splitlines()]
    header, rows = lines[0][1:], lines[1:]
    assert header == PRINCIPALS
    table = {}
    for route, *cells in rows:
        assert len(cells) == len(PRINCIPALS), route
        table[route] = {p: (c.split("/") * 2)[:2] for p, c in zip(PRINCIPALS, cells, strict=True)}
    return table


TABLE = _rows()


class World:
    """The two sessions, the tokens and the command ids a route needs."""

    def __init__(self, broker: Any, route: str) -> None:
        self.broker = broker
        self.tokens = {"none": None, "unknown": "unknown-token-1", "agent": AGENT}
        self.tokens.update({"agent2": AGENT2, "viewer": VIEWER, "admin": ADMIN})
        self.made: dict[str, str] = {}  # session -> id of a token limited to its namespace
        with broker.client(ADMIN) as admin:
            for name, role in (("agent-a", "agent"), ("viewer-a", "viewer"), ("admin-a", "admin")):
                body = {"role": role, "namespaces": ["team-a"]}
                self.tokens[name] = admin.post("/v1/tokens", json=body).json()["token"]
            for s, ns in NAMESPACE.items():
                made = register(
                    broker,
                    s,
                    namespace=ns,
                    job=f"job-{s}",
                    address="127.0.0.1:5678",
                    listener="pdb",
                )
                self.owner = made["owner"]
                if route == "read-events":
                    post_events(broker, *_event(s, f"seen-{s}")["events"])
                if route == "delete-token":
                    body = {"role": "viewer", "namespaces": [ns]}
                    self.made[s] = admin.post("/v1/tokens", json=body).json()["id"]
        self.delivered = {s: self._deliver(s) for s in NAMESPACE} if route == "ack" else {}

    def _deliver(self, session: str) -> str:
        with self.broker.client(ADMIN) as admin:
            admin.post(f"/v1/sessions/{session}/commands", json={"command": "break"})
        with self.broker.client(AGENT) as agent:
            polled = agent.get(f"/v1/sessions/{session}/commands", params={"wait": 0})
        return str(polled.json()["commands"][0]["id"])


def _listed(response: httpx.Response, key: str, session: str) -> str:
    if response.status_code != 200:
        return str(response.status_code)
    items = response.json()[key]
    found = any(item.get("id" if key == "sessions" else "session") == session for item in items)
    return "200+" if found else "200-"


def _stream(c: httpx.Client, s: str) -> str:
    with c.stream("GET", "/v1/events/stream", params={"session": s}) as response:
        return str(response.status_code)


def _bearer(c: httpx.Client) -> str:
    return c.headers.get("authorization", "").removeprefix("Bearer ")


def _event(s: str, eid: str) -> dict[str, Any]:
    return {"events": [{"id": eid, "session": s, "kind": "log", "fields": {"n": 1}}]}


Call = Callable[[httpx.Client, str, World], str]
ROUTES: dict[str, Call] = {
    "re-register": lambda c, s, w: c.put(f"/v1/sessions/{s}", json={"namespace": NAMESPACE[s]}),
    "move-to-c": lambda c, s, w: c.put(f"/v1/sessions/{s}", json={"namespace": "team-c"}),
    "move-to-a": lambda c, s, w: c.put(f"/v1/sessions/{s}", json={"namespace": "team-a"}),
    "heartbeat": lambda c, s, w: c.post(f"/v1/sessions/{s}/heartbeat", json={}),
    "get": lambda c, s, w: c.get(f"/v1/sessions/{s}"),
    "list": lambda c, s, w: _listed(c.get("/v1/sessions"), "sessions", s),
    "attach": lambda c, s, w: c.get(f"/v1/sessions/{s}/attach"),
    "post-event": lambda c, s, w: c.post("/v1/events", json=_event(s, "probe")),
    "read-events": lambda c, s, w: _listed(c.get("/v1/events"), "events", s),
    "stream": lambda c, s, w: _stream(c, s),
    "send-command": lambda c, s, w: c.post(f"/v1/sessions/{s}/commands", json={"command": "break"}),
    "job-command": lambda c, s, w: c.post(
        f"/v1/jobs/job-{s}/commands", json={"command": "break", "namespace": NAMESPACE[s]}
    ),
    "poll": lambda c, s, w: c.get(f"/v1/sessions/{s}/commands", params={"wait": 0}),
    "ack": lambda c, s, w: c.post(f"/v1/sessions/{s}/commands/{w.delivered[s]}/ack", json={}),
    "make-token": lambda c, s, w: c.post(
        "/v1/tokens", json={"role": "viewer", "namespaces": [NAMESPACE[s]]}
    ),
    "list-tokens": lambda c, s, w: c.get("/v1/tokens"),
    "delete-token": lambda c, s, w: c.delete(f"/v1/tokens/{w.made[s]}"),
    "whoami": lambda c, s, w: c.get("/v1/whoami"),
    "dashboard": lambda c, s, w: c.get("/v1/dashboard"),
    # the token in the body (as the form sends it); a bearer header alone is no login
    "login": lambda c, s, w: c.post("/v1/login", json={"token": _bearer(c) or "not-a-token"}),
    "login-state": lambda c, s, w: c.get("/v1/login"),
    "logout": lambda c, s, w: c.post("/v1/logout"),
    "notifiers": lambda c, s, w: c.get("/v1/notifiers"),
    "metrics": lambda c, s, w: c.get("/metrics"),
    "openapi": lambda c, s, w: c.get("/openapi.json"),
    "healthz": lambda c, s, w: c.get("/healthz"),
    "readyz": lambda c, s, w: c.get("/readyz"),
}


def _status(result: Any) -> str:
    return result if isinstance(result, str) else str(result.status_code)


@pytest.mark.parametrize("principal", PRINCIPALS)
@pytest.mark.parametrize("route", list(TABLE))
def test_authorization_matrix(broker, route, principal):
    world = World(broker, route)
    got = []
    for s in NAMESPACE:
        with broker.client(world.tokens[principal]) as c:
            got.append(_status(ROUTES[route](c, s, world)))
    assert got == TABLE[route][principal], f"{route} as {principal}: sa/sb"
    with broker.client(VIEWER) as c:
        for s, ns in NAMESPACE.items():  # never moved, and only its owner changed it
            session = c.get(f"/v1/sessions/{s}").json()
            assert (session["namespace"], session["owner"]) == (ns, world.owner)
            if principal != "agent":
                assert session["address"] == "127.0.0.1:5678"


def test_the_matrix_covers_every_route_of_the_app(broker):
    """Every path of the OpenAPI, plus the schema itself, has its row above."""
    with broker.client(VIEWER) as c:
        paths = set(c.get("/openapi.json").json()["paths"]) | {"/openapi.json"}
    covered = {
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/heartbeat",
        "/v1/sessions",
        "/v1/sessions/{session_id}/attach",
        "/v1/events",
        "/v1/events/stream",
        "/v1/sessions/{session_id}/commands",
        "/v1/sessions/{session_id}/commands/{command_id}/ack",
        "/v1/jobs/{job}/commands",
        "/v1/tokens",
        "/v1/tokens/{token_id}",
        "/v1/whoami",
        "/v1/dashboard",
        "/v1/login",
        "/v1/logout",
        "/v1/notifiers",
        "/metrics",
        "/openapi.json",
        "/healthz",
        "/readyz",
    }
    assert paths == covered and set(ROUTES) == set(TABLE)
