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
    """Records POSTed JSON per path; /fail answers 500."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[dict]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.bodies.setdefault(self.path, []).append(body)
                self.send_response(500 if self.path == "/fail" else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


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
