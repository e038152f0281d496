"""Command long-polls: no cap on waiters, one subscription per replica wakes them."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from tests.brokerkit import ADMIN, AGENT, wait_until

SESSIONS = 600  # beyond the old cap of 256 waiting polls per replica


async def _break_everyone(broker_url, poll_url, ids):
    limits = httpx.Limits(max_connections=SESSIONS + 50)
    agent = httpx.AsyncClient(
        base_url=poll_url, headers={"Authorization": f"Bearer {AGENT}"}, timeout=60, limits=limits
    )
    admin = httpx.AsyncClient(
        base_url=broker_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60
    )
    sent_at: dict[str, float] = {}

    async def poll(session_id):
        for attempt in range(3):  # as an agent's poller does: a reset connection polls again
            try:
                url = f"/v1/sessions/{session_id}/commands"
                reply = await agent.get(url, params={"wait": 30})
                break
            except httpx.TransportError:  # 600 connections at once, on a loaded machine
                if attempt == 2:
                    raise
        return session_id, reply.status_code, reply.json(), time.monotonic()

    async with agent, admin:
        polls = [asyncio.create_task(poll(i)) for i in ids]
        await asyncio.sleep(3)  # the polls are waiting (a late one finds its command at once)
        for session_id in ids:
            reply = await admin.post(
                f"/v1/sessions/{session_id}/commands", json={"command": "break"}
            )
            assert reply.status_code == 202, reply.text
            sent_at[session_id] = time.monotonic()
        results = await asyncio.gather(*polls)
    return [(i, status, body, done - sent_at[i]) for i, status, body, done in results]


@pytest.mark.timeout(120)
def test_600_waiting_polls_on_one_replica_each_get_their_break_from_another(
    start_broker, redis_url
):
    poller, sender = start_broker(), start_broker()
    ids = [f"s{i}" for i in range(SESSIONS)]
    with poller.client(AGENT) as c:
        for session_id in ids:
            assert c.put(f"/v1/sessions/{session_id}", json={"job": "big"}).status_code == 200
    with redis.Redis.from_url(redis_url) as r:  # both replicas subscribed
        wait_until(lambda: r.pubsub_numsub("breakpod:commands-queued")[0][1] >= 2)
    results = asyncio.run(_break_everyone(sender.url, poller.url, ids))
    assert all(status == 200 for _, status, _, _ in results)
    assert all(len(body["commands"]) == 1 for _, _, body, _ in results)
    assert {body["commands"][0]["session"] for _, _, body, _ in results} == set(ids)
    latencies = sorted(latency for *_, latency in results)
    assert latencies[int(0.99 * len(latencies))] < 5.0, latencies[-10:]  # 1 s unloaded
