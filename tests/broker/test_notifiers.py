"""Webhook notifiers against a real local HTTP receiver."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from breakpod_broker import keys
from tests.brokerkit import VIEWER, post_events, register, wait_until


class Receiver:
    """Records POSTed JSON (and idempotency keys) per path; /fail answers 500.
    ``stop()`` takes it down; ``start()`` brings it back on the same port."""

    def __init__(self, port: int = 0) -> None:
        self.bodies: dict[str, list[dict]] = {}
        self.keys: list[str] = []
        self.port = port
        self.start()

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.bodies.setdefault(self.path, []).append(body)
                receiver.keys.append(self.headers.get("Idempotency-Key", ""))
                self.send_response(500 if self.path == "/fail" else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def test_webhooks_get_routed_events_and_failures_are_retried_then_recorded(start_broker, receiver):
    notifiers = [
        {"name": "ops", "url": f"{receiver.url}/ok", "kinds": ["anomaly"]},
        {"name": "chat", "url": f"{receiver.url}/slack", "format": "slack", "kinds": ["parked"]},
        {"name": "broken", "url": f"{receiver.url}/fail", "retries": 2, "backoff_seconds": 0.05},
    ]
    broker = start_broker(BREAKPOD_NOTIFIERS=json.dumps(notifiers))
    register(broker, "s1", pod="train-0", namespace="ml")
    started = time.monotonic()
    response = post_events(
        broker,
        {"id": "e1", "session": "s1", "kind": "anomaly", "fields": {"reason": "NaN in loss"}},
        {"id": "e2", "session": "s1", "kind": "log"},
        {"id": "e3", "session": "s1", "kind": "parked", "fields": {"reason": "NaN in loss"}},
    )
    assert response.json()["accepted"] == 3
    assert time.monotonic() - started < 1.0  # ingestion does not wait for webhooks

    wait_until(lambda: receiver.bodies.get("/ok") and receiver.bodies.get("/slack"))
    [ops] = receiver.bodies["/ok"]
    assert ops["event"]["id"] == "e1" and ops["session"]["pod"] == "train-0"
    assert ops["attach"] == "breakpod attach s1"
    [chat] = receiver.bodies["/slack"]
    assert "parked" in chat["text"] and "train-0" in chat["text"] and "NaN in loss" in chat["text"]
    assert "state: `parked`" in chat["text"]

    with broker.client(VIEWER) as c:
        status = wait_until(lambda: _broken(c.get("/v1/notifiers").json()))
        assert status["recent_failures"][0]["event"] in ("e1", "e3")
        assert status["recent_failures"][0]["error"] == "HTTP 500"
        assert 'breakpod_notifier_failures_total{notifier="broken"}' in c.get("/metrics").text
    wait_until(lambda: len(receiver.bodies.get("/fail", [])) == 6)  # 2 events x (1 + 2 retries)
    assert post_events(broker, {"id": "e4", "session": "s1", "kind": "log"}).status_code == 200


def _broken(notifiers: list[dict]) -> dict | None:
    broken = next(n for n in notifiers if n["name"] == "broken")
    return broken if len(broken["recent_failures"]) == 2 else None


def test_two_replicas_deliver_each_event_once(start_broker, receiver):
    notifiers = json.dumps([{"name": "ops", "url": f"{receiver.url}/ok", "kinds": ["anomaly"]}])
    first, second = (start_broker(BREAKPOD_NOTIFIERS=notifiers) for _ in range(2))
    register(first, "s1")
    for i, broker in enumerate([first, second] * 5):
        post_events(broker, {"id": f"e{i}", "session": "s1", "kind": "anomaly"})
    wait_until(lambda: len(receiver.bodies.get("/ok", [])) >= 10)
    time.sleep(0.5)  # a duplicate would arrive by now
    assert sorted(b["event"]["id"] for b in receiver.bodies["/ok"]) == sorted(
        f"e{i}" for i in range(10)
    )


def test_a_job_left_by_a_crashed_replica_is_delivered_by_another(start_broker, receiver, redis_url):
    down = [{"name": "ops", "url": "http://127.0.0.1:9/", "retries": 10, "backoff_seconds": 5}]
    crashing = start_broker(BREAKPOD_NOTIFIERS=json.dumps(down))
    register(crashing, "s1")
    post_events(crashing, {"id": "e1", "session": "s1", "kind": "anomaly"})
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        wait_until(lambda: r.xpending(keys.NOTIFY, "notifiers")["pending"] == 1)
        crashing.proc.kill()  # mid-retry: its deliveries die with it
        crashing.proc.wait(5)
        up = [{"name": "ops", "url": f"{receiver.url}/ok"}]
        start_broker(BREAKPOD_NOTIFIERS=json.dumps(up), BREAKPOD_NOTIFY_CLAIM_SECONDS="1")
        wait_until(lambda: receiver.bodies.get("/ok"), timeout=15)
        assert [b["event"]["id"] for b in receiver.bodies["/ok"]] == ["e1"]
        wait_until(lambda: r.xlen(keys.NOTIFY) == 0)


def _outage(start_broker, receiver: Receiver, seconds: float) -> None:
    """Events arrive while the receiver is down for ``seconds``; after it returns
    each is delivered exactly once (one broker: nothing may be delivered twice)."""
    notifiers = [
        {
            "name": "ops",
            "url": f"{receiver.url}/ok",
            "kinds": ["anomaly", "parked"],
            "backoff_seconds": 0.05,
            "max_backoff_seconds": 0.5,
        }
    ]
    # a short claim period: a replica that re-claimed its own retrying jobs would
    # deliver them twice within the outage
    broker = start_broker(
        BREAKPOD_NOTIFIERS=json.dumps(notifiers), BREAKPOD_NOTIFY_CLAIM_SECONDS="1"
    )
    register(broker, "s1", pod="train-0")
    receiver.stop()
    sent = [f"e{i}" for i in range(6)]
    post_events(broker, *({"id": e, "session": "s1", "kind": "anomaly"} for e in sent))
    with broker.client(VIEWER) as c:
        wait_until(lambda: _retries(c.get("/metrics").text) >= 12, timeout=20)
        time.sleep(seconds)
        assert _retries(c.get("/metrics").text) > 12  # still trying when it returns
        receiver.start()
        wait_until(lambda: len(receiver.bodies.get("/ok", [])) >= len(sent), timeout=20)
        time.sleep(2.0)  # longer than the claim period and the longest backoff
        assert 'breakpod_notifier_failures_total{notifier="ops"}' not in c.get("/metrics").text
        assert c.get("/v1/notifiers").json()[0]["recent_failures"] == []
    assert sorted(b["event"]["id"] for b in receiver.bodies["/ok"]) == sent
    assert sorted(receiver.keys) == [f"ops:s1:{e}" for e in sent]


def _retries(metrics: str) -> float:
    line = next(
        (x for x in metrics.splitlines() if x.startswith("breakpod_notifier_retries_total{")), ""
    )
    return float(line.rpartition(" ")[2] or 0)


def test_a_receiver_down_for_a_while_gets_every_event_exactly_once(start_broker, receiver):
    _outage(start_broker, receiver, seconds=5.0)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_receiver_down_for_a_minute_gets_every_event_exactly_once(start_broker, receiver):
    _outage(start_broker, receiver, seconds=60.0)


def test_a_job_older_than_max_age_becomes_a_dead_letter(start_broker):
    down = [{"name": "ops", "url": "http://127.0.0.1:9/", "backoff_seconds": 0.05}]
    broker = start_broker(BREAKPOD_NOTIFIERS=json.dumps(down), BREAKPOD_NOTIFY_MAX_AGE="1")
    register(broker, "s1")
    post_events(broker, {"id": "e1", "session": "s1", "kind": "stall"})
    with broker.client(VIEWER) as c:
        [status] = wait_until(
            lambda: [n for n in c.get("/v1/notifiers").json() if n["recent_failures"]]
        )
        [dead] = status["recent_failures"]
        assert dead["event"] == "e1" and dead["kind"] == "stall" and int(dead["attempts"]) > 1
        assert 0.0 < float(dead["age"]) < 5.0  # given up near max_age, not at once
        assert "up to 1 s" in status["policy"]
        metrics = c.get("/metrics").text
        assert 'breakpod_notifier_failures_total{notifier="ops"} 1.0' in metrics


def test_every_format_says_rule_module_step_summary_state_and_attach(start_broker, receiver):
    notifiers = [
        {"name": "j", "url": f"{receiver.url}/json"},
        {"name": "s", "url": f"{receiver.url}/slack", "format": "slack"},
    ]
    broker = start_broker(BREAKPOD_NOTIFIERS=json.dumps(notifiers))
    register(broker, "s1", pod="train-0")
    anomaly = {"rule": "nan-loss", "module": "model.fc2", "step": 41200, "summary": "loss=nan"}
    parked = {"reason": "nan-loss at step 41200", "address": "127.0.0.1:5678"}
    post_events(
        broker,
        {"id": "a1", "session": "s1", "kind": "anomaly", "fields": anomaly},
        {"id": "p1", "session": "s1", "kind": "parked", "fields": parked},
    )
    wait_until(
        lambda: len(receiver.bodies.get("/json", [])) == len(receiver.bodies.get("/slack", [])) == 2
    )
    by_id = {b["event"]["id"]: b for b in receiver.bodies["/json"]}
    assert {k: by_id["a1"][k] for k in anomaly} == anomaly
    assert by_id["a1"]["attach"] == "breakpod attach s1" and by_id["a1"]["state"] == "running"
    assert by_id["p1"]["state"] == by_id["p1"]["session"]["state"] == "parked"
    assert by_id["p1"]["address"] == by_id["p1"]["session"]["address"] == "127.0.0.1:5678"
    texts = sorted(b["text"] for b in receiver.bodies["/slack"])
    anomaly_text, parked_text = texts
    for part in ("`nan-loss`", "`model.fc2`", "`41200`", "loss=nan", "breakpod attach s1"):
        assert part in anomaly_text
    for part in ("state: `parked`", "address: `127.0.0.1:5678`", "breakpod attach s1"):
        assert part in parked_text


def test_a_stale_state_event_after_finished_is_not_notified(start_broker, receiver, redis_url):
    """``finished`` is sticky for notifiers as for the session: a late ``parked`` or
    ``stall`` (after an outage) would invite someone to attach to a process that is gone."""
    notify = ["parked", "stall", "finished", "anomaly"]
    broker = start_broker(
        BREAKPOD_NOTIFIERS=json.dumps(
            [{"name": "ops", "url": f"{receiver.url}/ok", "kinds": notify}]
        )
    )
    for session in ("gone", "live", "ends"):
        register(broker, session)
    post_events(broker, {"id": "f", "session": "gone", "kind": "finished", "fields": {"exit": 0}})
    response = post_events(
        broker,
        {"id": "p", "session": "gone", "kind": "parked", "fields": {"address": "127.0.0.1:1"}},
        {"id": "s", "session": "gone", "kind": "stall", "fields": {"reason": "no step"}},
        {"id": "a", "session": "gone", "kind": "anomaly", "fields": {"reason": "NaN"}},
        {"id": "p", "session": "live", "kind": "parked", "fields": {"address": "127.0.0.1:2"}},
        {"id": "f", "session": "ends", "kind": "finished", "fields": {"exit": 1}},
        {"id": "p", "session": "ends", "kind": "parked", "fields": {"address": "127.0.0.1:3"}},
    )
    assert response.json()["accepted"] == 6  # stored all the same; only not notified
    with redis.Redis.from_url(redis_url) as r:  # every queued job delivered and removed
        wait_until(lambda: r.xlen(keys.NOTIFY) == 0 and len(receiver.bodies.get("/ok", [])) >= 4)
    told = sorted((b["event"]["session"], b["event"]["kind"]) for b in receiver.bodies["/ok"])
    assert told == [
        ("ends", "finished"),
        ("gone", "anomaly"),
        ("gone", "finished"),
        ("live", "parked"),
    ]


@pytest.mark.timeout(60)
def test_by_default_an_on_call_hook_hears_every_death_and_no_clean_exit(start_broker, receiver):
    """Default kinds: a non-zero exit (failed), a signal (killed) and silence (lost)
    reach the hook with the state and reason the session ended in; exit 0 does not."""
    broker = start_broker(
        BREAKPOD_HEARTBEAT_TTL_SECONDS="2",
        BREAKPOD_NOTIFIERS=json.dumps([{"name": "oncall", "url": f"{receiver.url}/hook"}]),
    )
    for session in ("fails", "termed", "clean", "silent"):
        register(broker, session, job="train", pod=f"train-{session}")
    post_events(
        broker,
        {"id": "f", "session": "fails", "kind": "finished", "fields": {"exit": 1}},
        {"id": "f", "session": "termed", "kind": "finished", "fields": {"signal": 15}},
        {"id": "f", "session": "clean", "kind": "finished", "fields": {"exit": 0}},
    )
    wait_until(lambda: len(receiver.bodies.get("/hook", [])) >= 3, timeout=40)  # a loaded CI
    time.sleep(1.0)  # a clean exit, had it been sent, would be here by now
    told = {b["event"]["session"]: b for b in receiver.bodies["/hook"]}
    assert sorted(told) == ["fails", "silent", "termed"]
    assert (told["fails"]["state"], told["fails"]["summary"]) == ("failed", "exit 1")
    assert told["fails"]["session"]["state"] == "failed"
    assert (told["termed"]["state"], told["termed"]["summary"]) == ("killed", "signal 15 (SIGTERM)")
    assert told["silent"]["event"]["kind"] == "lost" and told["silent"]["state"] == "lost"
    assert told["silent"]["summary"].startswith("no heartbeat")


def test_a_tests_own_broker_shares_no_redis_with_the_sessions_broker(broker, start_broker):
    """The session-wide broker lives on through every later test; on the same Redis
    its deaths sweeper claimed the silent session above and recorded its death with
    no notifier (the test then waited 40 s for a hook that never came), and its
    subscription counted as one of a test's replicas."""
    own = start_broker()
    register(own, "mine")
    register(broker, "theirs")
    with (
        redis.Redis.from_url(own.redis_url) as mine,
        redis.Redis.from_url(broker.redis_url) as shared,
    ):
        assert mine.exists(keys.session("mine")) and not mine.exists(keys.session("theirs"))
        assert shared.exists(keys.session("theirs")) and not shared.exists(keys.session("mine"))
        assert wait_until(lambda: mine.pubsub_numsub(keys.COMMANDS_QUEUED)[0][1] == 1)
