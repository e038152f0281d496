"""The broker's HTTP API against a real broker process and a real Redis."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import redis

from breakpod import protocol
from breakpod_broker import keys
from breakpod_broker.auth import PUBLIC_PATHS
from tests.brokerkit import ADMIN, AGENT, AGENT2, VIEWER, post_events, register

AUTHENTICATED = [
    ("GET", "/v1/sessions"),
    ("GET", "/v1/sessions/s1"),
    ("PUT", "/v1/sessions/s1"),
    ("POST", "/v1/sessions/s1/heartbeat"),
    ("GET", "/v1/events"),
    ("GET", "/v1/events/stream"),
    ("POST", "/v1/events"),
    ("POST", "/v1/sessions/s1/commands"),
    ("GET", "/v1/sessions/s1/commands"),
    ("GET", "/v1/sessions/s1/attach"),
    ("GET", "/v1/tokens"),
    ("GET", "/v1/notifiers"),
    ("GET", "/metrics"),
    ("GET", "/v1/whoami"),
]


def event(eid, session="s1", kind="anomaly", **fields):
    return {"id": eid, "session": session, "kind": kind, "fields": fields}


def test_health_checks_need_no_token_and_everything_else_does(broker):
    with broker.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").json() == {"status": "ready"}
        for method, path in AUTHENTICATED:
            response = c.request(method, path)
            assert response.status_code == 401, (method, path, response.text)
            assert "bearer token" in response.json()["detail"]
    with broker.client("not-a-known-token") as c:
        assert c.get("/v1/sessions").json()["detail"] == "unknown token"


def test_every_route_in_the_openapi_but_the_public_ones_requires_a_token(broker):
    """Public by design (auth.PUBLIC_PATHS): the health checks. The admission webhook,
    which takes no token, is its own TLS app, not a route of the plain-HTTP broker."""
    with broker.client(VIEWER) as c:
        spec = c.get("/openapi.json").json()
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    public = {r for r in routes if r[1].startswith(PUBLIC_PATHS)}
    assert {("GET", "/healthz"), ("GET", "/readyz")} <= public
    assert len(routes - public) > len(AUTHENTICATED)
    login = ("POST", "/v1/login")  # its token travels in the body: the dashboard's form
    assert login in routes
    with broker.client() as c:
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/docs").status_code == 404
        assert c.post(login[1], json={"token": "unknown-token-1"}).status_code == 401
        for method, path in sorted(routes - public - {login}):
            concrete = path.replace("{session_id}", "s1").replace("{command_id}", "ab")
            concrete = concrete.replace("{token_id}", "0" * 12)
            assert c.request(method, concrete).status_code == 401, (method, path)
        assert not any(path.startswith("/admission") for _, path in routes)
        assert c.post("/admission/mutate", json={}).status_code == 404


def test_wrong_role_is_forbidden(broker):
    register(broker, "s1")
    with broker.client(VIEWER) as c:
        response = c.post("/v1/sessions/s1/commands", json={"command": "break"})
        assert response.status_code == 403
        assert "needs: admin" in response.json()["detail"]
        assert c.post("/v1/events", json={"events": [event("e1")]}).status_code == 403
    with broker.client(AGENT) as c:
        assert c.get("/v1/sessions").status_code == 403
        assert c.get("/v1/tokens").status_code == 403
    with broker.client(ADMIN) as c:
        assert c.get("/v1/sessions").status_code == 200


def test_an_agent_token_cannot_write_another_agents_session(broker):
    register(broker, "s1", AGENT)
    response = post_events(broker, event("e1"), token=AGENT2)
    assert response.status_code == 403
    assert "belongs to another token" in response.json()["detail"]
    with broker.client(AGENT2) as c:
        assert c.put("/v1/sessions/s1", json={}).status_code == 403
        assert c.post("/v1/sessions/s1/heartbeat", json={}).status_code == 403
        assert c.get("/v1/sessions/s1/commands", params={"wait": 0}).status_code == 403
    assert post_events(broker, event("e1")).status_code == 200
    missing = post_events(broker, event("e2", session="nope"))
    assert missing.status_code == 404
    assert "register it first" in missing.json()["detail"]


def test_oversized_body_is_413_and_bad_input_is_422_with_a_message(broker):
    register(broker, "s1")
    with broker.client(AGENT) as c:
        big = {"events": [event("e1", blob="x" * (2 << 20))]}
        response = c.post("/v1/events", json=big)
        assert response.status_code == 413
        assert "larger than" in response.json()["detail"]
        headers = {"content-type": "application/json"}
        response = c.post("/v1/events", content=b'{"events": [', headers=headers)
        assert response.status_code == 422
        assert "JSON" in response.json()["message"]
        response = c.post("/v1/events", json={"events": [event("e1", kind="nonsense")]})
        assert response.status_code == 422
        assert "events.0.kind" in response.json()["message"]
        assert c.put("/v1/sessions/bad id!", json={}).status_code == 422
        assert c.put("/v1/sessions/s2", json={"address": "no port"}).status_code == 422


def test_events_are_deduplicated_and_filtered(broker):
    register(broker, "s1", namespace="ml")
    register(broker, "s2")
    first = post_events(broker, event("e1", reason="nan"), event("e2", kind="log"), event("e1"))
    assert first.json()["accepted"] == 2 and first.json()["duplicates"] == 1
    retry = post_events(broker, event("e1"), event("e3", session="s2", kind="stall"))
    assert retry.json()["accepted"] == 1 and retry.json()["cursors"][0] is None
    with broker.client(VIEWER) as c:
        every = c.get("/v1/events").json()["events"]
        assert [e["id"] for e in every] == ["e1", "e2", "e3"]
        assert every[0]["fields"] == {"reason": "nan"} and every[0]["namespace"] == "ml"
        kinds = c.get("/v1/events", params={"kind": ["stall", "log"]}).json()["events"]
        assert [e["id"] for e in kinds] == ["e2", "e3"]
        mine = c.get("/v1/events", params={"session": "s1"}).json()["events"]
        assert [e["id"] for e in mine] == ["e1", "e2"]
        after = c.get("/v1/events", params={"since": every[0]["cursor"]}).json()
        assert [e["id"] for e in after["events"]] == ["e2", "e3"]
        assert after["cursor"] == every[-1]["cursor"]
        assert c.get("/v1/events", params={"since": "yesterday"}).status_code == 422
        latest = c.get("/v1/events", params={"limit": 1}).json()["events"]
        assert [e["id"] for e in latest] == ["e3"]


def test_state_events_move_the_session_and_silence_shows_lost(broker):
    register(broker, "s1", pid=7)
    post_events(broker, event("e1", kind="parked", address="127.0.0.1:5999", reason="bp"))
    with broker.client(VIEWER) as c:
        s = c.get("/v1/sessions/s1").json()
        assert (s["state"], s["address"], s["listener"], s["reason"]) == (
            "parked",
            "127.0.0.1:5999",
            "pdb",
            "bp",
        )
        post_events(broker, event("e2", kind="resumed"))
        assert c.get("/v1/sessions/s1").json()["state"] == "running"
        with redis.Redis.from_url(broker.redis_url) as r:
            assert 0 < r.ttl(keys.alive("s1")) <= 60  # the heartbeat TTL
            r.delete(keys.alive("s1"))  # what the TTL does when heartbeats stop
        assert c.get("/v1/sessions/s1").json()["state"] == "lost"
        assert [
            s["id"] for s in c.get("/v1/sessions", params={"state": "lost"}).json()["sessions"]
        ] == ["s1"]
    with broker.client(AGENT) as c:
        assert c.post("/v1/sessions/s1/heartbeat", json={}).json()["state"] == "running"


def test_commands_are_long_polled_redelivered_until_acked_and_recorded(broker):
    register(broker, "s1")
    got = {}

    def poll():
        with broker.client(AGENT) as c:
            got["reply"] = c.get("/v1/sessions/s1/commands", params={"wait": 10}).json()

    poller = threading.Thread(target=poll)
    poller.start()
    with broker.client(ADMIN) as admin:
        sent = admin.post("/v1/sessions/s1/commands", json={"command": "dump-stacks"})
        assert sent.status_code == 202
    poller.join(10)
    assert [c["id"] for c in got["reply"]["commands"]] == [sent.json()["id"]]
    with broker.client(AGENT) as c:
        again = c.get("/v1/sessions/s1/commands", params={"wait": 0}).json()["commands"]
        assert [x["id"] for x in again] == [sent.json()["id"]]  # not acked: delivered again
        cid = sent.json()["id"]
        acked = c.post(f"/v1/sessions/s1/commands/{cid}/ack", json={"ok": True, "detail": "ok"})
        assert acked.status_code == 200
        assert c.post(f"/v1/sessions/s1/commands/{cid}/ack", json={}).status_code == 404
        assert c.get("/v1/sessions/s1/commands", params={"wait": 0}).json()["commands"] == []
    with broker.client(VIEWER) as c:
        recorded = c.get("/v1/events", params={"kind": "command"}).json()["events"]
    assert [e["fields"]["state"] for e in recorded] == ["queued", "delivered", "done"]


def test_attach_instructions_per_runtime(broker):
    register(
        broker, "k", runtime="kubernetes", pod="train-0", namespace="ml", address="127.0.0.1:5678"
    )
    register(
        broker, "c", runtime="compose", address="0.0.0.0:5678", attach_address="127.0.0.1:15678"
    )
    register(broker, "d", listener="debugpy", address="127.0.0.1:5679")
    register(broker, "n")
    with broker.client(VIEWER) as c:
        k = c.get("/v1/sessions/k/attach", params={"local_port": 40001}).json()
        assert k["port_forward"] == "kubectl port-forward -n ml pod/train-0 40001:5678"
        assert k["port_forward_argv"] == k["port_forward"].split()
        assert k["connect"] == "127.0.0.1:40001" and k["attach_command"] == "breakpod attach k"
        compose = c.get("/v1/sessions/c/attach").json()
        assert compose["connect"] == "127.0.0.1:15678" and compose["port_forward"] is None
        register(broker, "c2", runtime="compose", address="0.0.0.0:5678")
        assert c.get("/v1/sessions/c2/attach").json()["connect"] == "127.0.0.1:5678"
        d = c.get("/v1/sessions/d/attach").json()
        assert d["vscode_launch"]["configurations"][0]["connect"] == {
            "host": "127.0.0.1",
            "port": 5679,
        }
        assert c.get("/v1/sessions/n/attach").status_code == 409


def test_admin_made_tokens_work_on_every_replica_until_revoked(broker):
    register(broker, "a", namespace="team-a")
    register(broker, "b", namespace="team-b")
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-a"]}).json()
        assert made["id"] in [t["id"] for t in admin.get("/v1/tokens").json()]
    with broker.client(made["token"]) as c:
        assert [s["id"] for s in c.get("/v1/sessions").json()["sessions"]] == ["a"]
        assert c.get("/v1/sessions/b").status_code == 404
    with broker.client(ADMIN) as admin:
        assert admin.delete(f"/v1/tokens/{made['id']}").status_code == 204
    with broker.client(made["token"]) as c:
        assert c.get("/v1/sessions").status_code == 401


def test_metrics_in_prometheus_format(broker):
    register(broker, "s1")
    post_events(broker, event("e1"), event("e1"))
    with broker.client(VIEWER) as c:
        text = c.get("/metrics").text
    assert 'breakpod_events_ingested_total{kind="anomaly"}' in text
    assert "breakpod_events_duplicate_total" in text
    assert 'breakpod_sessions{state="running"} 1.0' in text
    assert 'breakpod_redis_latency_seconds_count{op="ping"}' in text


def test_sse_streams_new_events_and_resumes_at_last_event_id(broker):
    register(broker, "s1")
    post_events(broker, event("old"))
    seen: list[dict] = []
    with httpx.Client(base_url=broker.url, timeout=10) as c:
        headers = {"Authorization": f"Bearer {VIEWER}"}
        with c.stream("GET", "/v1/events/stream", params={"kind": "anomaly"}, headers=headers) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            threading.Timer(
                0.3, post_events, (broker, event("log1", kind="log"), event("new"))
            ).start()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen.append(json.loads(line[5:]))
                    break
        assert [e["id"] for e in seen] == ["new"]  # not "old" (before), not "log1" (filtered)
        headers["Last-Event-ID"] = "0-0"
        with c.stream("GET", "/v1/events/stream", headers=headers) as r:
            ids = [json.loads(line[5:])["id"] for line in _first_data_lines(r, 3)]
        assert ids == ["old", "log1", "new"]


def test_a_session_filtered_stream_gets_that_session_live_and_an_open_one_everything(broker):
    """Followers without a filter skip the per-event match; filtered ones must not."""
    register(broker, "s1")
    register(broker, "s2")
    headers = {"Authorization": f"Bearer {VIEWER}"}
    stream = "/v1/events/stream"
    with (
        httpx.Client(base_url=broker.url, timeout=10) as c,
        c.stream("GET", stream, params={"session": "s2"}, headers=headers) as one,
        c.stream("GET", stream, headers=headers) as every,
    ):
        events = [event("a", "s1"), event("b", "s2", kind="log"), event("c", "s1")]
        threading.Timer(0.3, post_events, (broker, *events, event("d", "s2"))).start()
        only = [json.loads(line[5:])["id"] for line in _first_data_lines(one, 2)]
        all_ = [json.loads(line[5:])["id"] for line in _first_data_lines(every, 4)]
    assert only == ["b", "d"]
    assert sorted(all_) == ["a", "b", "c", "d"]  # one batch is stored session by session


def _first_data_lines(response, n):
    lines = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            lines.append(line)
            if len(lines) == n:
                return lines
    return lines


@pytest.mark.parametrize(
    "bad", ["tokens: [1, 2]", "tokens: {shorttk: viewer}", "tokens: {longenough1: king}"]
)
def test_tokens_file_errors_say_what_is_wrong(tmp_path, bad):
    from breakpod_broker.errors import ConfigError
    from breakpod_broker.tokens import load_tokens_file

    path = tmp_path / "tokens.yaml"
    path.write_text(bad)
    with pytest.raises(ConfigError):
        load_tokens_file(path)


def test_tokens_file_roles_and_namespaces(tmp_path):
    from breakpod_broker.tokens import Role, digest, load_tokens_file

    path = tmp_path / "tokens.json"
    path.write_text(
        json.dumps(
            {
                "tokens": {
                    "viewer-tok-1": "viewer",
                    "agent-tok-1": {"role": "agent", "namespaces": ["ml"]},
                }
            }
        )
    )
    tokens = load_tokens_file(path)
    assert tokens[digest("viewer-tok-1")].role is Role.viewer
    agent = tokens[digest("agent-tok-1")]
    assert agent.may_see("ml") and not agent.may_see("other")


@pytest.mark.parametrize("token", [AGENT, VIEWER, ADMIN])
def test_whoami_answers_every_role_so_doctor_accepts_an_agent_token(broker, token):
    from breakpod._cli import doctor

    with broker.client(token) as c:
        assert c.get("/v1/whoami").json()["role"] in ("agent", "viewer", "admin")
    assert doctor.broker_check(broker.url, token).status == "ok"
    assert doctor.broker_check(broker.url, "wrong-token-00").status == "FAIL"


def test_the_broker_accepts_every_event_kind_the_agent_sends():
    import typing

    from breakpod import protocol
    from breakpod._link import emitter
    from breakpod_broker import models

    accepted = typing.get_args(models.EventIn.model_fields["kind"].annotation)
    assert emitter.KINDS.issubset(accepted)
    assert emitter.STATE_OF_KIND.items() <= protocol.STATE_OF_KIND.items()


def test_events_of_a_session_whose_id_is_as_long_as_allowed_are_kept(broker):
    """An event's id is its session's id, a dot and a number: 422 for a 128-character
    session id, so its anomaly and finished events were lost."""
    longest = "s" * protocol.SESSION_ID_MAX
    register(broker, longest)
    sent = post_events(broker, event(f"{longest}.12345", session=longest))
    assert sent.status_code == 200 and sent.json()["accepted"] == 1, sent.text
