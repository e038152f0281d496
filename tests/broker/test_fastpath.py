"""The heartbeat's and the command poll's fast paths (fastpath.py) answer the common
case as the route does, and leave every other case to the route, with its usual
status and message."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from breakpod_broker import commands, sessions
from breakpod_broker.app import create_app
from breakpod_broker.models import CommandList
from breakpod_broker.settings import BrokerSettings
from tests.brokerkit import ADMIN, AGENT, AGENT2, TOKENS, VIEWER


@pytest.fixture
def app_client(redis_url, monkeypatch):
    """The app in this process (so the route's use can be counted) on the real Redis."""
    routed: list[str] = []
    original = sessions._heartbeaten

    def counting(who, session_id, reply, interval):
        routed.append(session_id)
        return original(who, session_id, reply, interval)

    monkeypatch.setattr(sessions, "_heartbeaten", counting)
    original_poll = commands.answer_poll

    async def counting_poll(broker, who, session_id, wait):
        routed.append(f"poll {session_id}")
        return await original_poll(broker, who, session_id, wait)

    monkeypatch.setattr(commands, "answer_poll", counting_poll)  # the route's, not fastpath's
    settings = BrokerSettings(redis_url=redis_url, broker_tokens=TOKENS)
    with TestClient(create_app(settings)) as client:
        client.routed = routed
        yield client


def _auth(token):
    return {"Authorization": f"Bearer {token}"}


def test_a_heartbeat_is_served_below_the_router_with_the_routes_answer(app_client):
    c = app_client
    registered = c.put("/v1/sessions/fast", json={"job": "j"}, headers=_auth(AGENT)).json()
    reply = c.post("/v1/sessions/fast/heartbeat", json={"state": "parked"}, headers=_auth(AGENT))
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    beat = reply.json()
    assert beat["state"] == "parked" and beat["last_seen"] >= registered["last_seen"]
    assert beat.pop("heartbeat_seconds") == 15.0  # the interval to beat at (liveness.py)
    assert beat == c.get("/v1/sessions/fast", headers=_auth(VIEWER)).json()
    assert c.routed == []  # the route never ran
    empty = c.post("/v1/sessions/fast/heartbeat", headers=_auth(AGENT))  # no body at all
    assert empty.status_code == 200 and c.routed == []


@pytest.mark.parametrize(
    ("session", "token", "body", "status", "says"),
    [
        ("fast", None, {}, 401, "missing bearer token"),
        ("fast", "nope-not-a-token", {}, 401, "unknown token"),
        ("fast", VIEWER, {}, 403, "may not do this"),
        ("fast", AGENT, {"state": "dancing"}, 422, "state"),
        ("ghost", AGENT, {}, 404, "registers it with PUT"),
        ("fast", AGENT2, {}, 403, "belongs to another token"),
    ],
)
def test_every_other_case_gets_the_routes_status_and_message(
    app_client, session, token, body, status, says
):
    c = app_client
    assert c.put("/v1/sessions/fast", json={}, headers=_auth(AGENT)).status_code == 200
    headers = _auth(token) if token else {}
    reply = c.post(f"/v1/sessions/{session}/heartbeat", json=body, headers=headers)
    assert reply.status_code == status, reply.text
    assert says in reply.text


def test_a_large_body_still_meets_the_body_limit(app_client):
    c = app_client
    assert c.put("/v1/sessions/fast", json={}, headers=_auth(AGENT)).status_code == 200
    padding = {"state": "running", "reason": "x" * 2_000_000}
    reply = c.post("/v1/sessions/fast/heartbeat", json=padding, headers=_auth(AGENT))
    assert reply.status_code == 413, reply.text


def test_a_command_poll_is_served_below_the_router_with_the_routes_answer(app_client):
    c = app_client
    assert c.put("/v1/sessions/fast", json={"job": "j"}, headers=_auth(AGENT)).status_code == 200
    empty = c.get("/v1/sessions/fast/commands?wait=0", headers=_auth(AGENT))
    assert empty.status_code == 200 and empty.json() == {"commands": []}
    assert empty.headers["content-type"] == "application/json"
    own = c.post("/v1/sessions/fast/commands", json={"command": "break"}, headers=_auth(ADMIN))
    for_job = c.post("/v1/jobs/j/commands", json={"command": "resume"}, headers=_auth(ADMIN))
    assert own.status_code == for_job.status_code == 202
    fast = c.get("/v1/sessions/fast/commands?wait=0.5", headers=_auth(AGENT))
    assert c.routed == []  # the route never ran
    # the same answer as the route's (a query the fast path leaves to it), byte for byte
    routed = c.get("/v1/sessions/fast/commands?wait=0&x=1", headers=_auth(AGENT))
    assert c.routed == ["poll fast"]
    assert fast.status_code == routed.status_code == 200
    assert fast.content == routed.content
    # ... and what the CommandList model writes (the answer is encoded by hand)
    assert fast.content == CommandList.model_validate_json(fast.content).model_dump_json().encode()
    got = fast.json()["commands"]
    assert [(x["id"], x["session"], x["job"]) for x in got] == [
        (own.json()["id"], "fast", None),
        (for_job.json()["id"], "fast", "j"),
    ]


@pytest.mark.parametrize(
    ("session", "token", "query", "status", "says"),
    [
        ("fast", None, "", 401, "missing bearer token"),
        ("fast", "nope-not-a-token", "", 401, "unknown token"),
        ("fast", VIEWER, "", 403, "may not do this"),
        ("fast", AGENT, "?wait=soon", 422, "wait"),
        ("fast", AGENT, "?wait=301", 422, "wait"),
        ("ghost", AGENT, "", 404, "registers it with PUT"),
        ("fast", AGENT2, "", 403, "belongs to another token"),
    ],
)
def test_every_other_poll_gets_the_routes_status_and_message(
    app_client, session, token, query, status, says
):
    c = app_client
    assert c.put("/v1/sessions/fast", json={}, headers=_auth(AGENT)).status_code == 200
    headers = _auth(token) if token else {}
    reply = c.get(f"/v1/sessions/{session}/commands{query}", headers=headers)
    assert reply.status_code == status, reply.text
    assert says in reply.text
    if status in (404, 403) and token in (AGENT, AGENT2):  # answered by the fast path
        assert c.routed == [] and list(reply.json()) == ["detail"]
