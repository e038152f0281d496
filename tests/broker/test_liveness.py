"""The heartbeat interval grows with the sessions a broker holds; liveness scales with it."""

from __future__ import annotations

import time

import pytest
import redis

from breakpod._link.emitter import Emitter
from tests.brokerkit import AGENT, VIEWER, register, wait_until

# one beat per second for all sessions together: 30 sessions -> one beat per 30 s each
RATE = {"BREAKPOD_HEARTBEAT_RATE": "1"}


def beat(broker, session_id):
    with broker.client(AGENT) as c:
        reply = c.post(f"/v1/sessions/{session_id}/heartbeat", json={})
        assert reply.status_code == 200, reply.text
        return reply.json()


def state(broker, session_id):
    with broker.client(VIEWER) as c:
        return c.get(f"/v1/sessions/{session_id}").json()["state"]


@pytest.mark.timeout(60)
def test_the_interval_grows_with_the_session_count_and_the_alive_ttl_with_it(
    start_broker, redis_url
):
    broker = start_broker(**RATE)
    assert register(broker, "s00")["heartbeat_seconds"] == 15.0  # few sessions: the usual
    with redis.Redis.from_url(redis_url) as r:
        assert 25 <= r.ttl("breakpod:alive:{s00}") <= 30
        for i in range(1, 30):
            register(broker, f"s{i:02d}")
        # counted in the background every few seconds; the fast path answers too
        wait_until(lambda: beat(broker, "s00")["heartbeat_seconds"] == 30.0, timeout=15)
        assert 55 <= r.ttl("breakpod:alive:{s00}") <= 60  # 2 missed beats, as at 15 s
        assert register(broker, "s01")["heartbeat_seconds"] == 30.0


@pytest.mark.timeout(60)
def test_a_silent_session_is_lost_after_the_same_missed_beats_at_the_longer_interval(
    start_broker,
):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="2", **RATE)
    for i in range(30):
        register(broker, f"s{i:02d}")
    wait_until(lambda: beat(broker, "s00")["heartbeat_seconds"] == 30.0, timeout=15)
    silent_since = time.monotonic()
    beat(broker, "s00")  # alive for 2 s x 30 / 15 = 4 s
    time.sleep(2.5)  # past the unscaled 2 s: not lost yet
    assert state(broker, "s00") == "running"
    wait_until(lambda: state(broker, "s00") == "lost", timeout=8)
    assert 3.5 <= time.monotonic() - silent_since <= 7.0


@pytest.mark.timeout(60)
def test_the_agent_beats_at_the_interval_the_broker_asks_for(start_broker):
    broker = start_broker(**RATE)
    for i in range(30):
        register(broker, f"s{i:02d}")
    wait_until(lambda: beat(broker, "s00")["heartbeat_seconds"] == 30.0, timeout=15)
    emitter = Emitter(broker.url, AGENT, session_id="agent-1", info={}, poll_commands=False)
    emitter.start()
    try:
        wait_until(lambda: emitter.beat_seconds == 30.0, timeout=10)  # the registration says
    finally:
        emitter.close()
