"""The heartbeat interval grows with the sessions a broker holds; liveness scales with it."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis
from fastapi.testclient import TestClient

from breakpod._link.emitter import Emitter
from breakpod_broker.app import create_app
from breakpod_broker.settings import BrokerSettings
from tests.brokerkit import AGENT, TOKENS, VIEWER, register, wait_until

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


@pytest.mark.timeout(60)
def test_a_beat_asks_for_the_interval_its_alive_key_was_set_by(redis_url, monkeypatch):
    """The session count behind both is recounted in the background. A recount that lands
    while the heartbeat's script runs must not split them: the beat set a 30 s TTL (two
    missed beats at 15 s) and asked for 30 s beats, one missed beat from lost."""
    settings = BrokerSettings(redis_url=redis_url, broker_tokens=TOKENS, heartbeat_rate=1)
    auth = {"Authorization": f"Bearer {AGENT}"}
    with TestClient(create_app(settings)) as client:
        assert client.put("/v1/sessions/s00", json={}, headers=auth).status_code == 200
        broker = client.app.state.broker
        real = broker.scripts.heartbeat

        async def recount_lands(*args, **kwargs):  # type: ignore[no-untyped-def]
            broker.liveness.sessions = 30  # at 1 beat/s in all: one beat per 30 s each
            return await real(*args, **kwargs)

        scripts = dataclasses.replace(broker.scripts, heartbeat=recount_lands)
        monkeypatch.setattr(broker, "scripts", scripts)
        reply = client.post("/v1/sessions/s00/heartbeat", json={}, headers=auth)
        assert reply.status_code == 200, reply.text
        with redis.Redis.from_url(redis_url) as r:
            ttl = r.ttl("breakpod:alive:{s00}")
    asked = reply.json()["heartbeat_seconds"]
    assert 2 * asked - 2 <= ttl <= 2 * asked, (ttl, asked)  # two missed beats, as asked
