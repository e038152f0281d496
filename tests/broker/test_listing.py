"""GET /v1/sessions: cursor pages, filters applied before any cap, counts per state."""

from __future__ import annotations

import pytest

from tests.brokerkit import ADMIN, AGENT, VIEWER


def register_many(broker, ids, **fields):
    with broker.client(AGENT) as c:
        for session_id in ids:
            assert c.put(f"/v1/sessions/{session_id}", json=fields).status_code == 200


def all_pages(c, **params):
    seen, pages, cursor = [], 0, None
    while True:
        reply = c.get("/v1/sessions", params={**params, **({"cursor": cursor} if cursor else {})})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        seen += [s["id"] for s in body["sessions"]]
        pages += 1
        cursor = body["next"]
        if cursor is None:
            return seen, pages


def test_pages_list_every_session_once_newest_first_even_while_heartbeats_arrive(broker):
    ids = [f"s{i:02d}" for i in range(23)]
    register_many(broker, ids, job="train")
    with broker.client(VIEWER) as c, broker.client(AGENT) as agent:
        first = c.get("/v1/sessions", params={"limit": 5}).json()
        assert [s["id"] for s in first["sessions"]] == ids[::-1][:5]
        for session_id in ids[::3]:  # heartbeats must not reorder the listing
            assert agent.post(f"/v1/sessions/{session_id}/heartbeat", json={}).status_code == 200
        seen = [s["id"] for s in first["sessions"]]
        rest, pages = all_pages(c, limit=5, cursor=first["next"])
    assert seen + rest == ids[::-1]
    assert pages == 4  # 18 more sessions at 5 per page


def test_a_namespace_filter_applies_before_the_cap(broker):
    """The team's 5 oldest sessions are found behind 1,006 newer ones of another namespace."""
    register_many(broker, [f"team-{i}" for i in range(5)], namespace="team")
    register_many(broker, [f"big-{i}" for i in range(1006)], namespace="big")
    with broker.client(VIEWER) as c:
        page = c.get("/v1/sessions", params={"namespace": "team"}).json()
        assert sorted(s["id"] for s in page["sessions"]) == [f"team-{i}" for i in range(5)]
        assert page["next"] is None and page["counts"] == {"running": 5}
        unfiltered = c.get("/v1/sessions").json()
        assert len(unfiltered["sessions"]) == 1000 and unfiltered["next"] is not None
        assert unfiltered["counts"] == {"running": 1011}
    with broker.client(ADMIN) as c:
        token = c.post("/v1/tokens", json={"role": "viewer", "namespaces": ["team"]}).json()
    with broker.client(token["token"]) as c:
        seen, _ = all_pages(c, limit=2)
        assert sorted(seen) == [f"team-{i}" for i in range(5)]
        assert c.get("/v1/sessions", params={"namespace": "big"}).json()["sessions"] == []


def test_job_and_state_filters_with_counts_of_every_state_in_the_job(broker):
    register_many(broker, ["a0", "a1", "a2"], job="alpha")
    register_many(broker, ["b0"], job="beta")
    with broker.client(AGENT) as agent:
        agent.post("/v1/sessions/a1/heartbeat", json={"state": "parked"})
    with broker.client(VIEWER) as c:
        seen, _ = all_pages(c, job="alpha", limit=1)
        assert seen == ["a2", "a1", "a0"]
        parked = c.get("/v1/sessions", params={"job": "alpha", "state": "parked"}).json()
        assert [s["id"] for s in parked["sessions"]] == ["a1"]
        assert parked["counts"] == {"running": 2, "parked": 1}
        assert c.get("/v1/sessions", params={"job": "beta"}).json()["counts"] == {"running": 1}


@pytest.mark.parametrize("cursor", ["nonsense", "1.5", "1.5:bad id", "1.5:" + "x" * 150])
def test_a_cursor_that_is_not_one_is_refused_in_one_line(broker, cursor):
    with broker.client(VIEWER) as c:
        reply = c.get("/v1/sessions", params={"cursor": cursor})
    assert reply.status_code == 422
    assert "next" in str(reply.json()["detail"])


def test_the_cli_pages_through_every_session_the_broker_selects(broker):
    from breakpod._link.client import BrokerClient

    register_many(broker, [f"j{i}" for i in range(12)], job="big")
    register_many(broker, ["other"], job="small")
    found = BrokerClient(broker.url, VIEWER).sessions(limit=5, job="big")
    assert [s["id"] for s in found] == [f"j{i}" for i in range(12)][::-1]
