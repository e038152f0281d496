"""Listing counts: counted in Redis, shared by the replicas through Redis."""

from __future__ import annotations

import pytest
import redis

from tests.brokerkit import ADMIN, AGENT, VIEWER


def register_many(broker, ids, **fields):
    with broker.client(AGENT) as c:
        for session_id in ids:
            assert c.put(f"/v1/sessions/{session_id}", json=fields).status_code == 200


@pytest.mark.timeout(60)
def test_counts_cover_lost_finished_and_the_viewers_namespaces(start_broker, redis_url):
    broker = start_broker()  # not the shared one: its counts of earlier tests are cached
    register_many(broker, ["a-run", "a-gone", "a-done"], namespace="team-a", job="j")
    register_many(broker, ["b-run"], namespace="team-b", job="j")
    register_many(broker, ["none"])
    with broker.client(AGENT) as c:
        body = {"state": "finished"}
        assert c.post("/v1/sessions/a-done/heartbeat", json=body).status_code == 200
    with redis.Redis.from_url(redis_url) as r:
        r.delete("breakpod:alive:{a-gone}", "breakpod:alive:{a-done}")
    with broker.client(ADMIN) as c:
        team_a = c.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team-a"]}).json()
    with broker.client(VIEWER) as c:
        assert c.get("/v1/sessions").json()["counts"] == {"running": 3, "lost": 1, "finished": 1}
        by_job = c.get("/v1/sessions", params={"job": "j", "namespace": "team-b"}).json()
        assert by_job["counts"] == {"running": 1}
    with broker.client(team_a["token"]) as c:
        assert c.get("/v1/sessions").json()["counts"] == {"running": 1, "lost": 1, "finished": 1}


@pytest.mark.timeout(120)
def test_a_replica_takes_the_counts_another_one_shared(start_broker):
    first, second = start_broker(), start_broker()
    register_many(first, [f"s{i:04d}" for i in range(1100)])  # above the inline threshold
    with first.client(VIEWER) as c:
        assert c.get("/v1/sessions", params={"limit": 10}).json()["counts"] == {"running": 1100}
    register_many(first, [f"t{i:02d}" for i in range(20)])
    with second.client(VIEWER) as c:  # its first page: the shared count, not one of its own
        page = c.get("/v1/sessions", params={"limit": 10}).json()
    assert page["counts"] == {"running": 1100}
    assert [s["id"] for s in page["sessions"]][:2] == ["t19", "t18"]  # the page itself is live
