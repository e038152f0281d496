"""Two broker processes on one Redis behave as one broker."""

from __future__ import annotations

import json
import threading

import httpx

from tests.brokerkit import ADMIN, AGENT, VIEWER, post_events, register


def test_an_event_posted_to_one_replica_reaches_the_other_replicas_sse(start_broker):
    broker, other = start_broker(), start_broker()
    register(broker, "s1")
    received: list[dict] = []
    headers = {"Authorization": f"Bearer {VIEWER}"}
    event = {"id": "e1", "session": "s1", "kind": "anomaly", "fields": {"reason": "nan"}}
    with (
        httpx.Client(base_url=other.url, timeout=10) as c,
        c.stream("GET", "/v1/events/stream", headers=headers) as response,
    ):
        threading.Timer(0.3, post_events, (broker, event)).start()
        for line in response.iter_lines():
            if line.startswith("data:"):
                received.append(json.loads(line[5:]))
                break
    assert received[0]["id"] == "e1" and received[0]["fields"] == {"reason": "nan"}


def test_a_command_posted_to_one_replica_reaches_an_agent_polling_the_other(start_broker):
    broker, other = start_broker(), start_broker()
    register(other, "s1")
    reply: dict = {}

    def poll() -> None:
        with other.client(AGENT) as c:
            reply.update(c.get("/v1/sessions/s1/commands", params={"wait": 10}).json())

    poller = threading.Thread(target=poll)
    poller.start()
    with broker.client(ADMIN) as c:
        sent = c.post("/v1/sessions/s1/commands", json={"command": "break"}).json()
    poller.join(12)
    assert [c["id"] for c in reply["commands"]] == [sent["id"]]
    with broker.client(AGENT) as c:  # and the acknowledgement may go to either replica
        assert c.post(f"/v1/sessions/s1/commands/{sent['id']}/ack", json={}).status_code == 200
    with other.client(VIEWER) as c:
        assert c.get("/v1/sessions/s1").json()["state"] == "running"
