"""Events survive broker and Redis restarts; an agent rides out a broker outage."""

from __future__ import annotations

import statistics
import time

from breakpod._link.emitter import Emitter
from breakpod_broker.redis_server import EmbeddedRedis, free_port
from tests.brokerkit import AGENT, VIEWER, post_events, register, wait_until


def event_ids(broker, **params):
    """Event ids, oldest first; None while the broker answers 503 (Redis coming back)."""
    with broker.client(VIEWER) as c:
        response = c.get("/v1/events", params={"limit": 1000, **params})
    if response.status_code == 503:
        return None
    return [e["id"] for e in response.json()["events"]]


def test_events_survive_a_broker_restart_and_a_redis_restart(tmp_path, start_broker):
    server = EmbeddedRedis(tmp_path / "redis", fsync="always").start()
    try:
        broker = start_broker(redis=server.url)
        register(broker, "s1")
        post_events(broker, *({"id": f"e{i}", "session": "s1", "kind": "log"} for i in range(5)))
        broker.stop()
        broker.start()
        assert event_ids(broker) == [f"e{i}" for i in range(5)]
        server.stop()  # SIGTERM: Redis exits; only the AOF on disk remains
        server.start()
        wait_until(lambda: event_ids(broker) == [f"e{i}" for i in range(5)])
        with broker.client(VIEWER) as c:
            assert c.get("/v1/sessions/s1").json()["state"] in ("running", "lost")
    finally:
        server.stop()


def test_an_agent_emitting_while_the_broker_is_down_never_blocks_and_loses_nothing(start_broker):
    port = free_port()
    emitter = Emitter(
        f"http://127.0.0.1:{port}",
        AGENT,
        session_id="train-1",
        info={"job": "train"},
        queue_size=5000,
        poll_commands=False,
    ).start()
    try:
        step_times = []
        for step in range(2000):  # the training loop, broker down
            started = time.perf_counter()
            emitter.emit("log", {"step": step})
            step_times.append(time.perf_counter() - started)
        p99 = statistics.quantiles(step_times, n=100)[98]
        assert p99 < 0.005, f"emit p99 {p99 * 1000:.2f} ms while the broker is down"
        assert emitter.sent == 0 and emitter.dropped == 0
        broker = start_broker(port=port)
        assert emitter.flush(timeout=30), "the queue did not drain after the broker came back"
        steps = [int(i.split(".")[1]) for i in event_ids(broker, session="train-1")]
        assert steps == list(range(1001, 2001))  # the newest page; the total comes next
        assert emitter.sent == 2000 and emitter.dropped == 0
        with broker.client(VIEWER) as c:
            text = c.get("/metrics").text
        assert 'breakpod_events_ingested_total{kind="log"} 2000.0' in text
    finally:
        emitter.close()


def test_a_full_queue_drops_the_oldest_and_counts_them(start_broker):
    port = free_port()
    emitter = Emitter(
        f"http://127.0.0.1:{port}",
        AGENT,
        session_id="train-2",
        info={},
        queue_size=100,
        poll_commands=False,
    ).start()
    try:
        for step in range(150):
            emitter.emit("log", {"step": step})
        assert emitter.dropped == 50
        broker = start_broker(port=port)
        assert emitter.flush(timeout=30)
        got = [e for e in event_ids(broker, session="train-2")]
        assert got == [f"train-2.{i}" for i in range(51, 151)]  # ids count from 1
    finally:
        emitter.close()
