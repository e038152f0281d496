"""Deaths pushed: a ``lost`` event when a session's heartbeats stop, recorded by one of
any number of replicas within a second of the heartbeat TTL, seen by a follower of
the event stream without anyone reading the session list."""

from __future__ import annotations

import signal
import time

import pytest

from tests.broker.test_flow import SCRIPT, agent_env
from tests.brokerkit import AGENT, VIEWER, Follower, post_events, register, wait_until

TTL = "2"  # seconds a silent session stays alive


def lost_events(broker, session_id=None):
    params = {"kind": "lost", "limit": 1000, **({"session": session_id} if session_id else {})}
    with broker.client(VIEWER) as c:
        return c.get("/v1/events", params=params).json()["events"]


def beat(broker, session_id):
    with broker.client(AGENT) as c:
        assert c.post(f"/v1/sessions/{session_id}/heartbeat", json={}).status_code == 200


@pytest.mark.timeout(60)
def test_each_death_is_pushed_once_by_one_of_three_replicas(start_broker):
    replicas = [start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS=TTL) for _ in range(3)]
    follower = Follower(replicas[2].url)
    follower.start()
    follower.ready.wait(10)
    for i in range(30):
        register(replicas[i % 3], f"s{i:02d}", job="j", rank=i)
        if i == 7:  # parked before its heartbeats stop
            post_events(replicas[0], {"id": "p", "session": "s07", "kind": "parked"})
    silent_since = time.time()
    wait_until(lambda: len([e for e in follower.events if e["kind"] == "lost"]) == 30, timeout=15)
    time.sleep(2.5)  # every replica swept a few more times meanwhile
    events = lost_events(replicas[1])
    assert sorted(e["session"] for e in events) == [f"s{i:02d}" for i in range(30)]
    late = [e["received"] - silent_since for e in events]
    assert max(late) < float(TTL) + 1.5, late  # the TTL, then at most a sweep or so
    parked = next(e for e in events if e["session"] == "s07")
    assert parked["fields"]["was"] == "parked"
    assert parked["fields"]["reason"].startswith("no heartbeat for 2s (was parked)")


@pytest.mark.timeout(60)
def test_a_session_that_beats_again_is_alive_and_its_next_silence_is_another_death(
    start_broker,
):
    # a TTL of 4 s: a beat every 0.5 s stays alive even when a loaded machine holds this
    # test back for 3 s (with 2 s, a 2 s stall once read as a death: CI with 3 workers)
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="4")
    register(broker, "s1")
    for _ in range(12):  # beating: no death for 6 s, one and a half TTLs
        time.sleep(0.5)
        beat(broker, "s1")
    assert lost_events(broker) == []
    wait_until(lambda: len(lost_events(broker)) == 1, timeout=10)
    beat(broker, "s1")  # back (a network partition healed)
    with broker.client(VIEWER) as c:
        assert c.get("/v1/sessions/s1").json()["state"] == "running"
    wait_until(lambda: len(lost_events(broker)) == 2, timeout=10)


@pytest.mark.timeout(60)
def test_an_ended_session_is_not_lost(start_broker):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS=TTL)
    register(broker, "done")
    register(broker, "gone")
    post_events(broker, {"id": "f", "session": "done", "kind": "finished", "fields": {"exit": 1}})
    wait_until(lambda: len(lost_events(broker)) == 1, timeout=8)
    time.sleep(1.5)
    assert [e["session"] for e in lost_events(broker)] == ["gone"]


@pytest.mark.timeout(120)
def test_a_sigkilled_parked_process_is_pushed_as_lost_to_a_follower(start_broker, spawn):
    """The OOM killer's way: SIGKILL, no word from the process. A follower of the
    event stream learns of it without reading the session list, within the TTL of
    the last beat (a real agent beats every 12-15 s: the TTL is longer here)."""
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="20")
    follower = Follower(broker.url)
    follower.start()
    follower.ready.wait(10)
    child = spawn(SCRIPT, env=agent_env(broker), stdin="closed")
    child.park_port()
    wait_until(lambda: any(e["kind"] == "parked" for e in follower.events), timeout=20)
    time.sleep(3)  # a beat or two
    assert [e for e in follower.events if e["kind"] == "lost"] == []  # alive while it beats
    child.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    child.wait()
    lost = wait_until(lambda: [e for e in follower.events if e["kind"] == "lost"], timeout=30)
    assert time.monotonic() - killed_at < 20 + 2  # the TTL after the last beat, then a sweep
    assert lost[0]["fields"]["was"] == "parked"
