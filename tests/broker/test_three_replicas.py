"""Three broker processes on one Redis: agents spread over two, a follower on the third,
commands sent through any; delivered and acknowledged exactly as with one broker."""

from __future__ import annotations

import threading

import pytest

from tests.brokerkit import ADMIN, AGENT, Follower, wait_until

SESSIONS = 30


@pytest.mark.timeout(120)
def test_commands_through_three_replicas_reach_every_agent_once_and_the_follower_sees_all(
    start_broker,
):
    replicas = [start_broker() for _ in range(3)]
    agents_at = {f"s{i}": replicas[i % 2] for i in range(SESSIONS)}  # agents on replicas 0, 1
    for session_id, replica in agents_at.items():
        with replica.client(AGENT) as c:
            assert c.put(f"/v1/sessions/{session_id}", json={"job": "wide"}).status_code == 200
    follower = Follower(replicas[2].url)
    follower.start()
    assert follower.ready.wait(20)
    got: dict[str, list[str]] = {}

    def agent(session_id, replica):
        with replica.client(AGENT) as c:
            commands = c.get(f"/v1/sessions/{session_id}/commands", params={"wait": 20}).json()
            got[session_id] = [x["id"] for x in commands["commands"]]
            for command_id in got[session_id]:
                ack = c.post(f"/v1/sessions/{session_id}/commands/{command_id}/ack", json={})
                assert ack.status_code == 200

    polls = [threading.Thread(target=agent, args=item) for item in agents_at.items()]
    for poll in polls:
        poll.start()
    sent = {}
    for i, session_id in enumerate(agents_at):
        with replicas[i % 3].client(ADMIN) as c:  # sent through every replica in turn
            reply = c.post(f"/v1/sessions/{session_id}/commands", json={"command": "break"})
            sent[session_id] = [reply.json()["id"]]
    for poll in polls:
        poll.join(30)
    assert got == sent
    with replicas[2].client(AGENT) as c:  # nothing is left to redeliver anywhere
        for session_id in agents_at:
            again = c.get(f"/v1/sessions/{session_id}/commands", params={"wait": 0}).json()
            assert again["commands"] == []

    def states():
        done = [
            e for e in follower.events if e["kind"] == "command" and e["fields"]["state"] == "done"
        ]
        return {e["session"] for e in done} == set(agents_at) and done

    done = wait_until(states, timeout=20)
    assert len(done) == SESSIONS  # each acknowledged once, seen once
