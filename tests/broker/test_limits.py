"""Input limits: nesting and size of event fields, NaN where a number is typed,
and stored records no read may fail on (written straight into Redis, as an
older broker or a hand might have)."""

from __future__ import annotations

import json

import redis

from breakpod_broker import keys
from breakpod_broker.limits import MAX_DEPTH, MAX_FIELDS_BYTES
from tests.brokerkit import AGENT, VIEWER, post_events, register


def nested(depth: int) -> dict:
    fields: dict = {}
    inner = fields
    for _ in range(depth):
        inner["k"] = {}
        inner = inner["k"]
    return fields


def event(eid, session="s1", **fields):
    return {"id": eid, "session": session, "kind": "log", "fields": fields}


def raw_post(broker, path, text, method="POST"):
    with broker.client(AGENT) as c:
        headers = {"content-type": "application/json"}
        return c.request(method, path, content=text, headers=headers)


def test_fields_nested_too_deep_get_422_naming_the_path(broker):
    register(broker, "s1")
    assert post_events(broker, event("ok", **nested(MAX_DEPTH))).status_code == 200
    for depth in (MAX_DEPTH + 1, 300):
        response = post_events(broker, event(f"deep{depth}", **nested(depth)))
        assert response.status_code == 422, response.text
        message = response.json()["message"]
        assert "events.0.fields" in message and "fields.k.k.k" in message
    with broker.client(VIEWER) as c:
        assert [e["id"] for e in c.get("/v1/events").json()["events"]] == ["ok"]


def test_a_body_nested_past_any_parser_is_4xx(broker):
    register(broker, "s1")
    for text in ("[" * 100_000, '{"events": ' + "[" * 900 + "]" * 900 + "}"):
        response = raw_post(broker, "/v1/events", text)
        assert 400 <= response.status_code < 500, response.text


def test_fields_over_the_size_limit_get_422(broker):
    register(broker, "s1")
    response = post_events(broker, event("ok"), event("big", blob="x" * MAX_FIELDS_BYTES))
    assert response.status_code == 422
    assert "events.1.fields" in response.json()["detail"]


def test_nan_and_infinity_where_a_number_is_typed_get_422(broker):
    register(broker, "s1")
    for text in ('{"pid": NaN}', '{"rank": Infinity}', '{"pid": -Infinity}'):
        response = raw_post(broker, "/v1/sessions/x", text, method="PUT")
        assert response.status_code == 422, response.text
        assert "pid" in response.text or "rank" in response.text
    body = '{"events": [{"id": "e", "session": "s1", "kind": "log", "time": NaN}]}'
    assert raw_post(broker, "/v1/events", body).status_code == 422
    body = '{"command": "break", "reason": NaN}'
    with broker.client(AGENT) as c:  # wrong role: refused before the body matters
        assert c.post("/v1/sessions/s1/commands", content=body).status_code in (403, 422)


def test_stored_records_no_read_can_fail_on_are_skipped(broker, redis_url):
    register(broker, "s1")
    post_events(broker, event("before"))
    deep = {**event("deep", **nested(400)), "time": 1.0, "received": 1.0}
    with redis.Redis.from_url(redis_url) as r:
        r.xadd(keys.EVENTS, {"event": json.dumps(deep)})
        r.xadd(keys.EVENTS, {"event": "[" * 5000})
        r.xadd(keys.EVENTS, {"event": '{"id": "no-fields"}'})
        r.xadd(keys.EVENTS, {"other": "x"})
        r.hset(keys.session("husk"), "last_seen", "1")  # what an expired-then-touched hash is
        r.zadd(keys.SESSIONS, {"husk": 2})
    post_events(broker, event("after"))
    with broker.client(VIEWER) as c:
        page = c.get("/v1/events")
        assert page.status_code == 200, page.text
        assert [e["id"] for e in page.json()["events"]] == ["before", "after"]
        assert c.get("/v1/events", params={"since": "0"}).status_code == 200
        listed = c.get("/v1/sessions")
        assert listed.status_code == 200 and [s["id"] for s in listed.json()["sessions"]] == ["s1"]
        assert c.get("/v1/sessions/husk").status_code == 404
        with c.stream("GET", "/v1/events/stream", params={"since": "0"}) as stream:
            data = [json.loads(x[5:]) for x in _lines(stream, "data:", 2)]
    assert [e["id"] for e in data] == ["before", "after"]
    with broker.client(AGENT) as c:  # the husk can be registered again
        assert c.put("/v1/sessions/husk", json={}).status_code == 200


def _lines(response, prefix, n):
    found = []
    for line in response.iter_lines():
        if line.startswith(prefix):
            found.append(line)
            if len(found) == n:
                return found
    return found
