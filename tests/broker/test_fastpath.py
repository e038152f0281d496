"""The heartbeat's and the command poll's fast paths (fastpath.py) answer the common
case as the route does, and leave every other case to the route, with its usual
status and message."""

from __future__ import annotations

import json
import random
import re

import pytest
from fastapi.testclient import TestClient

from breakpod_broker import commands, events, sessions
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
    original_accept = events.accept

    async def counting_accept(broker, who, batch, *, plain):
        routed.append("events")
        return await original_accept(broker, who, batch, plain=plain)

    monkeypatch.setattr(events, "accept", counting_accept)  # the route's, not fastpath's
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


# -- event ingest ---------------------------------------------------------------

PLAIN = {"Content-Type": "application/json"}  # what the agent sends: the fast path takes it
# the same declaration in other words: FastAPI reads it as JSON, the fast path leaves it
ROUTED = {"Content-Type": "application/json; charset=utf-8"}


def _event(session, event_id, kind="anomaly", **fields):
    return {"id": event_id, "session": session, "kind": kind, "fields": fields}


def _body(*events):
    return json.dumps({"events": list(events)}).encode()


def _nested(depth):
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def test_an_event_post_is_served_below_the_router_with_the_routes_answer(app_client):
    c = app_client
    for s in ("fast", "fast2"):
        assert (
            c.put(f"/v1/sessions/{s}", json={"job": "j"}, headers=_auth(AGENT)).status_code == 200
        )
    # a float written in full (an anomaly's value) is as plain as 1.5
    events = [
        _event("fast", "e1", loss=1.5, value=0.6931471805599453),
        _event("fast2", "e2", "parked", reason="step 7"),
    ]
    headers = {**_auth(AGENT), **PLAIN}
    fast = c.post("/v1/events", content=_body(*events), headers=headers)
    assert c.routed == []  # the route never ran
    assert fast.status_code == 200, fast.text
    assert fast.headers["content-type"] == "application/json"
    got = fast.json()
    assert got["accepted"] == 2 and got["duplicates"] == 0 and all(got["cursors"])
    # the state change applied, as through the route
    assert c.get("/v1/sessions/fast2", headers=_auth(VIEWER)).json()["state"] == "parked"
    # a retry: the route's answer (all duplicates), byte for byte
    again = c.post("/v1/events", content=_body(*events), headers=headers)
    routed = c.post("/v1/events", content=_body(*events), headers={**_auth(AGENT), **ROUTED})
    assert c.routed == ["events"]
    assert again.status_code == routed.status_code == 200
    assert again.content == routed.content == b'{"accepted":0,"duplicates":2,"cursors":[null,null]}'
    stored = c.get("/v1/events", headers=_auth(VIEWER)).json()["events"]
    assert [(e["id"], e["kind"], e["fields"]) for e in stored] == [
        ("e1", "anomaly", {"loss": 1.5, "value": 0.6931471805599453}),
        ("e2", "parked", {"reason": "step 7"}),
    ]


@pytest.fixture
def limited_agent(broker):
    """An agent token limited to namespace team-a (made through the API)."""
    with broker.client(ADMIN) as c:
        made = c.post("/v1/tokens", json={"role": "agent", "namespaces": ["team-a"]})
        assert made.status_code == 201, made.text
        return made.json()["token"]


FIELDS_OVER = "x" * (64 * 1024 + 10)  # one event's fields past MAX_FIELDS_BYTES
CASES = {
    # name: (token, body); "own"/"other" stand for the sessions of AGENT
    "one event": (AGENT, _body(_event("own", "{id}", loss=1.5, step=3))),
    "a batch over two sessions": (
        AGENT,
        _body(
            *(_event(s, f"{{id}}-{s}-{n}", "log", n=n) for s in ("own", "other") for n in (1, 2))
        ),
    ),
    "a state change and a listener": (
        AGENT,
        _body(_event("own", "{id}", "listening", address="127.0.0.1:5678", backend="pdb")),
    ),
    "duplicate keys (the last one counts)": (
        AGENT,
        b'{"events": [{"id": "{id}", "session": "own", "kind": "log", "kind": "anomaly"}]}',
    ),
    "unicode": (AGENT, _body(_event("own", "{id}", note="grad \u00e9\u65e5 \U0001f525"))),
    "no token": (None, _body(_event("own", "{id}"))),
    "unknown token": ("nope-not-a-token", _body(_event("own", "{id}"))),
    "a viewer": (VIEWER, _body(_event("own", "{id}"))),
    "an admin (not the owner)": (ADMIN, _body(_event("own", "{id}"))),
    "another agent's session": (AGENT2, _body(_event("own", "{id}"))),
    "a namespace the token may not see": ("limited", _body(_event("other", "{id}"))),
    "a session nobody registered": (AGENT, _body(_event("ghost", "{id}"))),
    "an unknown kind": (AGENT, _body(_event("own", "{id}", "dancing"))),
    "no id": (AGENT, _body({"session": "own", "kind": "log"})),
    "a bad session id": (AGENT, _body(_event("no:colons", "{id}"))),
    "no events": (AGENT, _body()),
    "fields too deep": (AGENT, _body(_event("own", "{id}", deep=_nested(40)))),
    "fields over 64 KiB": (AGENT, _body(_event("own", "{id}", blob=FIELDS_OVER))),
    "NaN": (
        AGENT,
        b'{"events": [{"id": "{id}", "session": "own", "kind": "log", "fields": {"loss": NaN}}]}',
    ),
    "too many events": (AGENT, _body(*(_event("own", f"{{id}}-{n}") for n in range(1001)))),
    "a body over the limit": (
        AGENT,
        _body(*(_event("own", f"{{id}}-{n}", pad="p" * 60_000) for n in range(20))),
    ),
    "malformed JSON": (AGENT, b'{"events": [{"id": "{id}", '),
    "not an object": (AGENT, b'[{"id": "{id}"}]'),
    "not UTF-8": (AGENT, b'{"events": [{"id": "{id}", "session": "own", "kind": "\xff"}]}'),
    "empty": (AGENT, b""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_event_post_gets_the_same_answer_from_the_fast_path_and_the_route(
    broker, limited_agent, case
):
    """A real broker process: each body through the fast path (the agent's plain
    Content-Type) and through the route (the same type, with a charset, which the fast
    path leaves to it): the same status, headers and body (the cursors aside: each
    copy gets its own event ids, of one length), and the same events stored."""
    with broker.client(AGENT) as c:
        for s, ns in (("own", "team-a"), ("other", "team-b")):
            assert c.put(f"/v1/sessions/{s}", json={"namespace": ns}).status_code == 200
    token, body = CASES[case]
    token = limited_agent if token == "limited" else token
    answers = []
    for how, headers in (("fast", PLAIN), ("slow", ROUTED)):
        with broker.client(token) as c:
            reply = c.post(
                "/v1/events", content=body.replace(b"{id}", how.encode()), headers=headers
            )
        answers.append(reply)
    fast, routed = answers
    assert fast.status_code == routed.status_code, (fast.text, routed.text)
    for name in ("content-type", "www-authenticate"):
        assert fast.headers.get(name) == routed.headers.get(name)
    if fast.status_code != 200:
        # the same bytes, but for the ids each copy sent (422s echo their input)
        assert fast.content.replace(b"fast", b"{id}") == routed.content.replace(b"slow", b"{id}")
        return
    a, b = fast.json(), routed.json()
    assert len(a["cursors"]) == len(b["cursors"]) and all(a["cursors"]) and all(b["cursors"])
    assert {**a, "cursors": None} == {**b, "cursors": None}
    assert len(fast.content) == len(routed.content)  # cursors of one length: same encoding
    with broker.client(VIEWER) as c:
        stored = c.get("/v1/events", params={"limit": 1000}).json()["events"]
    copies = {how: [] for how in ("fast", "slow")}
    for e in stored:
        how = e["id"].split("-")[0]
        copies[how].append({**e, "id": e["id"].removeprefix(how)} | _times_left_out)
    assert copies["fast"] == copies["slow"] and copies["fast"]


_times_left_out = {"cursor": None, "received": None, "time": None}


@pytest.mark.parametrize(
    ("case", "status"),
    [
        ("another agent's session", 403),
        ("a session nobody registered", 404),
        ("too many events", 413),
        ("fields over 64 KiB", 422),
    ],
)
def test_the_routes_refusals_after_validation_are_answered_by_the_fast_path(
    app_client, case, status
):
    """The cases the test above compares that the fast path answers itself (the route,
    had it run, would have counted)."""
    c = app_client
    for s, ns in (("own", "team-a"), ("other", "team-b")):
        assert c.put(f"/v1/sessions/{s}", json={"namespace": ns}, headers=_auth(AGENT)).is_success
    token, body = CASES[case]
    body = body.replace(b"{id}", b"fast")
    reply = c.post("/v1/events", content=body, headers={**_auth(token), **PLAIN})
    assert reply.status_code == status, reply.text
    assert c.routed == [] and list(reply.json()) == ["detail"]


# What plain_numbers refuses, as a regex: slower, and plain (the reference it must equal).
UNUSUAL = re.compile(rb"[0-9]{19}|[0-9][eE][+-]?[0-9]{3}")


@pytest.mark.parametrize(
    "body",
    [b'{"a": 1e400}', b'{"a": 1E+0400}', b'{"a": -9223372036854775809}', b'{"a": NaN}', b"1e-999"],
)
def test_bodies_with_unusual_numbers_are_not_plain(body):
    assert not events.plain_numbers(body)


@pytest.mark.parametrize(
    "body",
    [b'{"a": 1e40, "b": 0.6931471805599453, "c": 1764631234.1234567}', b'{"id": "3-e123f"}'],
)
def test_usual_numbers_are_plain(body):
    assert events.plain_numbers(body)


def test_plain_numbers_equals_its_regex_on_random_bodies():
    rng = random.Random(7)
    alphabet = b'0123456789eE+-.,:{}[]" aN'
    for _ in range(30_000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        expected = b"NaN" not in body and b"Infinity" not in body and not UNUSUAL.search(body)
        assert events.plain_numbers(body) == expected, body
