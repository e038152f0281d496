"""Each rank's last step rides on its heartbeat and is stored on its session, so the
dashboard can show a straggler's lag behind its job's furthest rank before it stalls."""

from __future__ import annotations

import pytest

from breakpod._link.client import BrokerClient
from tests.broker.test_flow import agent_env, cli
from tests.brokerkit import AGENT, VIEWER, register, wait_until


def session(broker, session_id):
    with broker.client(VIEWER) as c:
        return c.get(f"/v1/sessions/{session_id}").json()


def listed_steps(broker):
    with broker.client(VIEWER) as c:
        return {s["id"]: s.get("step") for s in c.get("/v1/sessions").json()["sessions"]}


@pytest.mark.timeout(60)
def test_a_heartbeat_stores_the_last_step_and_one_without_keeps_it(broker):
    register(broker, "r0", job="lag", rank=0)
    register(broker, "r1", job="lag", rank=1)
    client = BrokerClient(broker.url, AGENT)
    assert client.heartbeat("r0", 1200)["step"] == 1200  # the agent's own client
    assert client.heartbeat("r1", 950)["step"] == 950
    assert client.heartbeat("r1")["step"] == 950  # a beat that counts no step keeps it
    assert session(broker, "r0")["step"] == 1200
    assert {k: v for k, v in listed_steps(broker).items() if k in ("r0", "r1")} == {
        "r0": 1200,
        "r1": 950,
    }
    with broker.client(AGENT) as c:  # a negative step is refused, as any bad field
        reply = c.post("/v1/sessions/r0/heartbeat", json={"step": -1})
    assert reply.status_code == 422 and session(broker, "r0")["step"] == 1200


LOOP = """
    import time
    import breakpod
    from breakpod._link import emitter
    emitter.ensure_started()
    for step in range(100000):
        time.sleep(0.005)
        breakpod.step()
"""


@pytest.mark.timeout(90)
def test_a_stepping_process_reports_its_step_on_its_heartbeat(broker, spawn):
    """The stall watchdog counts the steps; the next heartbeat (about 15 s) carries them."""
    child = spawn(LOOP, env=agent_env(broker, BREAKPOD_STALL_AFTER="600"))

    def reported():
        with broker.client(VIEWER) as c:
            sessions = c.get("/v1/sessions").json()["sessions"]
        return [s for s in sessions if s.get("pid") == child.proc.pid and s.get("step")]

    [first] = wait_until(reported, timeout=40)
    assert first["step"] > 10
    wait_until(lambda: session(broker, first["id"])["step"] > first["step"], timeout=40)


@pytest.mark.timeout(60)
def test_breakpod_sessions_shows_each_ranks_step_and_its_lag(broker):
    for rank, step in ((0, 300), (1, 120)):
        register(broker, f"cli{rank}", job="cli-lag", rank=rank, world_size=2)
        BrokerClient(broker.url, AGENT).heartbeat(f"cli{rank}", step)
    listing = cli(broker, "sessions").stdout
    assert listing.splitlines()[0].split()[:7] == [
        "ID", "JOB", "POD/HOST", "RANK", "STATE", "STEP", "REASON"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in listing.splitlines()[1:] if line.strip()}
    assert rows["cli0"][4:6] == ["running", "300"]
    assert rows["cli1"][4:8] == ["running", "120", "(180", "behind)"]
