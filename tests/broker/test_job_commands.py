"""Job-wide commands: one request, stored once, each session of the job gets it once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import redis

from tests.brokerkit import ADMIN, AGENT, AGENT2, VIEWER, register, wait_until

JOB = "train-42"


def send(broker, job=JOB, token=ADMIN, **body):
    with broker.client(token) as c:
        return c.post(f"/v1/jobs/{job}/commands", json={"command": "break", **body})


def poll(broker, session_id, wait=0.0, token=AGENT):
    with broker.client(token) as c:
        reply = c.get(f"/v1/sessions/{session_id}/commands", params={"wait": wait}, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["commands"]


def ack(broker, session_id, command_id, token=AGENT, ok=True):
    with broker.client(token) as c:
        return c.post(
            f"/v1/sessions/{session_id}/commands/{command_id}/ack",
            json={"ok": ok, "detail": "parks"},
        )


@pytest.mark.timeout(60)
def test_one_request_stores_one_command_that_each_session_of_the_job_gets_once(broker):
    for i in range(3):
        register(broker, f"r{i}", job=JOB, rank=i)
    register(broker, "other-job", job="train-43")
    register(broker, "no-job")
    sent = send(broker, reason="look at step 7")
    assert sent.status_code == 202, sent.text
    command = sent.json()
    assert command["job"] == JOB and command["namespace"] is None
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        assert r.xlen(f"breakpod:job-commands:{{/{JOB}}}") == 1  # stored once
        assert r.keys("breakpod:commands:*") == []  # not one queue entry per session
    for i in range(3):
        got = poll(broker, f"r{i}")
        assert [(c["id"], c["command"], c["session"], c["job"]) for c in got] == [
            (command["id"], "break", f"r{i}", JOB)
        ]
        assert poll(broker, f"r{i}")[0]["id"] == command["id"]  # not acked: handed out again
        assert ack(broker, f"r{i}", command["id"]).status_code == 200
        assert poll(broker, f"r{i}") == []  # acknowledged: never again
        assert ack(broker, f"r{i}", command["id"]).status_code == 404
    assert poll(broker, "other-job") == [] and poll(broker, "no-job") == []
    with broker.client(VIEWER) as c:
        recorded = c.get("/v1/events", params={"kind": "command"}).json()["events"]
    assert sorted((e["session"], e["fields"]["state"]) for e in recorded) == [
        ("r0", "done"),
        ("r1", "done"),
        ("r2", "done"),
    ]


@pytest.mark.timeout(60)
def test_a_session_registered_after_the_command_does_not_get_it(broker):
    register(broker, "early", job=JOB)
    first = send(broker).json()
    register(broker, "late", job=JOB)
    register(broker, "early", job=JOB, rank=0)  # a re-registration keeps its cursor
    assert [c["id"] for c in poll(broker, "early")] == [first["id"]]
    assert poll(broker, "late") == []
    second = send(broker, command="resume").json()
    assert [c["id"] for c in poll(broker, "late")] == [second["id"]]
    # unacknowledged job commands come oldest first, after the session's own
    with broker.client(ADMIN) as admin:
        own = admin.post("/v1/sessions/early/commands", json={"command": "dump-stacks"}).json()
    assert [c["id"] for c in poll(broker, "early")] == [own["id"], first["id"], second["id"]]
    assert ack(broker, "early", second["id"]).status_code == 200  # handled in order: covers first
    assert [c["id"] for c in poll(broker, "early")] == [own["id"]]


@pytest.mark.timeout(60)
def test_a_session_moved_to_another_job_gets_none_of_that_jobs_earlier_commands(broker):
    register(broker, "mover", job="job-a")
    register(broker, "other", job="job-b")
    send(broker, job="job-a")
    old = send(broker, job="job-b").json()
    register(broker, "mover", job="job-b")  # the same session, re-registered elsewhere
    assert poll(broker, "mover") == []  # job-b's break was for the ranks there then
    assert poll(broker, "mover") == []
    new = send(broker, job="job-b", command="resume").json()
    assert [c["id"] for c in poll(broker, "mover")] == [new["id"]] != [old["id"]]
    register(broker, "mover", job="job-b", rank=1)  # a re-registration in place keeps it
    assert [c["id"] for c in poll(broker, "mover")] == [new["id"]]


@pytest.mark.timeout(60)
def test_namespaces_and_roles_are_checked_as_for_session_commands(broker):
    register(broker, "a0", job=JOB, namespace="team-a")
    register(broker, "b0", AGENT2, job=JOB, namespace="team-b")
    with broker.client(ADMIN) as c:
        team_a = c.post("/v1/tokens", json={"role": "admin", "namespaces": ["team-a"]}).json()
    assert send(broker, token=VIEWER, namespace="team-a").status_code == 403
    assert send(broker, token=AGENT, namespace="team-a").status_code == 403
    refused = send(broker, token=team_a["token"], namespace="team-b")
    assert refused.status_code == 404 and "no running job" in refused.json()["detail"]
    assert send(broker, namespace="team-c").status_code == 404  # nobody there
    assert send(broker, job="nope").status_code == 404
    sent = send(broker, token=team_a["token"], namespace="team-a")
    assert sent.status_code == 202, sent.text
    assert [c["id"] for c in poll(broker, "a0")] == [sent.json()["id"]]
    assert poll(broker, "b0", token=AGENT2) == []  # same job name, another namespace


async def _waiting_polls_get_one_job_command(poll_url, send_url, ids):
    limits = httpx.Limits(max_connections=len(ids) + 10)
    agent = httpx.AsyncClient(
        base_url=poll_url, headers={"Authorization": f"Bearer {AGENT}"}, timeout=60, limits=limits
    )
    async with agent:
        polls = [
            asyncio.create_task(agent.get(f"/v1/sessions/{i}/commands", params={"wait": 30}))
            for i in ids
        ]
        await asyncio.sleep(2)  # waiting (a late poll would find the command at once)
        assert not any(p.done() for p in polls)
        started = time.monotonic()
        async with httpx.AsyncClient(
            base_url=send_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
        ) as admin:
            sent = await admin.post(f"/v1/jobs/{JOB}/commands", json={"command": "break"})
        replies = await asyncio.gather(*polls)
        return sent.json(), replies, time.monotonic() - started


@pytest.mark.timeout(120)
def test_waiting_polls_on_one_replica_are_woken_by_a_job_command_sent_to_another(
    start_broker, redis_url
):
    poller, sender = start_broker(), start_broker()
    ids = [f"w{i}" for i in range(200)]
    with poller.client(AGENT) as c:
        for session_id in ids:
            assert c.put(f"/v1/sessions/{session_id}", json={"job": JOB}).status_code == 200
    with redis.Redis.from_url(redis_url) as r:  # both replicas subscribed
        wait_until(lambda: r.pubsub_numsub("breakpod:job-commands-queued")[0][1] >= 2)
    sent, replies, took = asyncio.run(
        _waiting_polls_get_one_job_command(poller.url, sender.url, ids)
    )
    assert all(reply.status_code == 200 for reply in replies)
    got = [reply.json()["commands"] for reply in replies]
    assert all([c["id"] for c in commands] == [sent["id"]] for commands in got)
    assert sorted(c[0]["session"] for c in got) == sorted(ids)
    assert took < 10.0, took  # well under 1 s unloaded


@pytest.mark.timeout(120)
def test_cli_send_to_a_job_is_one_request(broker):
    for i in range(3):
        register(broker, f"c{i}", job=JOB, rank=i, namespace="ml")
    cmd = [sys.executable, "-m", "breakpod._cli.main", "send", JOB, "break"]
    cmd += ["--broker", broker.url, "--broker-token", ADMIN]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("queued break for c") == 3, done.stdout
    with redis.Redis.from_url(broker.redis_url, decode_responses=True) as r:
        assert r.xlen(f"breakpod:job-commands:{{ml/{JOB}}}") == 1
    assert [c["command"] for c in poll(broker, "c1")] == ["break"]
