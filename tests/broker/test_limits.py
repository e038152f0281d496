"""Input limits: nesting and size of event fields, NaN where a number is typed,
and stored records no read may fail on (written straight into Redis, as an
older broker or a hand might have)."""

from __future__ import annotations

import json
import time

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


def test_stored_records_no_read_can_fail_on_are_skipped(broker):
    register(broker, "s1")
    post_events(broker, event("before"))
    deep = {**event("deep", **nested(400)), "time": 1.0, "received": 1.0}
    with redis.Redis.from_url(broker.redis_url) as r:
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


HALF_PAIRS = ('"\\ud800"', '"x\\udfffy"', '"\\uDBFF"')


def with_half(doc: dict, half: str) -> str:
    """``doc`` as JSON, each string "HALF" replaced by the JSON text ``half``."""
    return json.dumps(doc).replace('"HALF"', half)


def test_half_of_a_utf16_pair_gets_422_on_every_route_and_a_pair_is_text(broker):
    """JSON can escape a surrogate with no partner; it is no text, and storing or
    answering it failed with a 500 that then broke every read of the events."""
    register(broker, "s1")
    bodies = [
        ("PUT", "/v1/sessions/s2", {"job": "HALF"}),
        ("POST", "/v1/sessions/s1/heartbeat", {"reason": "HALF"}),
        ("POST", "/v1/events", {"events": [event("e", x="HALF", n=12345678901234567890)]}),
        ("POST", "/v1/events", {"events": [{**event("e"), "fields": {"HALF": 1}}]}),
    ]
    for half in HALF_PAIRS:
        for method, path, doc in bodies:
            response = raw_post(broker, path, with_half(doc, half), method=method)
            assert response.status_code == 422, (path, half, response.text)
            assert "UTF-16" in response.json()["detail"], response.text
    text = "\U0001f600 \\ud800"  # an emoji (escaped as a pair) and a backslash's text
    pair = raw_post(broker, "/v1/events", json.dumps({"events": [event("pair", text=text)]}))
    assert pair.status_code == 200, pair.text
    with broker.client(VIEWER) as c:
        page = c.get("/v1/events", params={"session": "s1"})
        assert page.status_code == 200, page.text
        assert [e["fields"]["text"] for e in page.json()["events"]] == [text]
        assert c.get("/v1/sessions/s2").status_code == 404


def test_a_stored_half_pair_reads_as_a_replacement_character(broker):
    register(broker, "s1")
    now = time.time()
    stored = {**event("old", reason="a\ud800b"), "time": now, "received": now}
    with redis.Redis.from_url(broker.redis_url) as r:
        r.xadd(keys.EVENTS, {"event": json.dumps(stored)})
    post_events(broker, event("new"))
    with broker.client(VIEWER) as c:
        for params in ({}, {"since": "0"}):
            page = c.get("/v1/events", params=params)
            assert page.status_code == 200, page.text
            events = page.json()["events"]
            assert [e["id"] for e in events] == ["old", "new"], (params, events)
            assert events[0]["fields"]["reason"] == "a\ufffdb"


def test_the_fields_limit_counts_utf8_bytes_whichever_encoder_runs(broker):
    register(broker, "s1")
    emoji = "\U0001f600" * (MAX_FIELDS_BYTES // 4 + 10)  # under the limit in characters
    accents = "\u00e9" * (MAX_FIELDS_BYTES // 2 - 100)  # under it in UTF-8, not in escapes
    big = 12345678901234567890  # past 63 bits: the strict encoder's path
    for extra in ({}, {"n": big}):
        refused = post_events(broker, event(f"emoji{len(extra)}", blob=emoji, **extra))
        assert refused.status_code == 422, refused.text
        taken = post_events(broker, event(f"accents{len(extra)}", blob=accents, **extra))
        assert taken.status_code == 200, taken.text
