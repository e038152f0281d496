"""SSE followers share one Redis read per replica; slow ones are dropped and resume."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import redis

from tests.brokerkit import ADMIN, VIEWER, post_events, register, wait_until


def event(eid, session="s1", **fields):
    return {"id": eid, "session": session, "kind": "anomaly", "fields": fields}


class Follower(threading.Thread):
    """Reads an SSE stream, keeping each event's id; ``ready`` once the stream is open."""

    def __init__(self, url, token=VIEWER, headers=None):
        super().__init__(daemon=True)
        self.url, self.token, self.extra = url, token, headers or {}
        self.ids: list[str] = []
        self.ready = threading.Event()
        self.ended = threading.Event()

    def run(self):
        headers = {"Authorization": f"Bearer {self.token}", **self.extra}
        with (
            contextlib.suppress(httpx.HTTPError),  # the broker stopped at teardown
            httpx.Client(base_url=self.url, timeout=30) as c,
            c.stream("GET", "/v1/events/stream", headers=headers) as response,
        ):
            self.ready.set()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.ids.append(json.loads(line[5:])["id"])
        self.ended.set()


def blocked_clients(redis_url):
    with redis.Redis.from_url(redis_url) as r:
        return int(r.info("clients")["blocked_clients"])


@pytest.mark.timeout(60)
def test_forty_followers_cost_one_blocking_redis_read_and_all_get_every_event(
    start_broker, redis_url
):
    broker = start_broker()
    register(broker, "s1")
    idle = wait_until(lambda: blocked_clients(redis_url) or None, timeout=10)
    followers = [Follower(broker.url) for _ in range(40)]
    for f in followers:
        f.start()
    for f in followers:
        assert f.ready.wait(20)
    time.sleep(0.5)  # the streams are open and idle: none may hold a Redis read of its own
    assert blocked_clients(redis_url) <= idle
    assert post_events(broker, *(event(f"e{i}") for i in range(5))).status_code == 200
    wait_until(lambda: all(len(f.ids) == 5 for f in followers), timeout=20)
    assert {tuple(f.ids) for f in followers} == {("e0", "e1", "e2", "e3", "e4")}


@pytest.mark.timeout(60)
def test_a_follower_limited_to_a_namespace_gets_only_its_events(broker):
    register(broker, "mine", namespace="team")
    register(broker, "theirs", namespace="other")
    with broker.client(ADMIN) as c:
        token = c.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team"]}).json()
    limited, everything = Follower(broker.url, token["token"]), Follower(broker.url)
    for f in (limited, everything):
        f.start()
        assert f.ready.wait(20)
    post_events(broker, event("t1", "theirs"), event("m1", "mine"), event("t2", "theirs"))
    wait_until(lambda: len(everything.ids) == 3, timeout=20)
    assert sorted(everything.ids) == ["m1", "t1", "t2"]
    wait_until(lambda: limited.ids == ["m1"], timeout=5)


@pytest.mark.timeout(90)
def test_a_follower_that_stops_reading_is_dropped_and_resumes_without_a_gap(start_broker):
    broker = start_broker(BREAKPOD_FOLLOWER_QUEUE="40")
    register(broker, "s1")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", broker.port))
    request = f"GET /v1/events/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {VIEWER}\r\n"
    slow.sendall(request.encode() + b"\r\n")
    fast = Follower(broker.url)
    fast.start()
    assert fast.ready.wait(20)
    time.sleep(0.5)
    padding = "x" * 60_000
    posted = []
    for batch in range(25):  # ~24 MB: far more than the slow socket's buffers hold
        events = [event(f"b{batch}-{i}", pad=padding) for i in range(15)]
        started = time.monotonic()
        assert post_events(broker, *events).status_code == 200
        assert time.monotonic() - started < 10  # the stalled follower never holds ingest up
        posted += [e["id"] for e in events]
    wait_until(lambda: len(fast.ids) == len(posted), timeout=30)
    assert fast.ids == posted
    received = _read_until_closed(slow)  # dropped: the broker ends the stream
    ids = [json.loads(line[5:])["id"] for line in received.splitlines() if line.startswith("data:")]
    last = [line[4:] for line in received.splitlines() if line.startswith("id: ")][-1]
    assert 0 < len(ids) < len(posted) and ids == posted[: len(ids)]
    rest = Follower(broker.url, headers={"Last-Event-ID": last})
    rest.start()
    wait_until(lambda: len(ids) + len(rest.ids) >= len(posted), timeout=30)
    assert ids + rest.ids == posted


def _read_until_closed(sock, timeout=60.0):
    sock.settimeout(timeout)
    chunks = []
    while True:
        data = sock.recv(1 << 20)
        if not data:
            break
        chunks.append(data)
        if b"\r\n0\r\n\r\n" in b"".join(chunks[-2:]):  # the chunked body's end
            break
    return b"".join(chunks).decode(errors="replace")
