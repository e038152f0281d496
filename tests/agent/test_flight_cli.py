"""``breakpod flight SESSION`` through a real broker: asked of a live job, and read back
from the events of one that has ended."""

from __future__ import annotations

from tests.agent.test_attach_cli import run_cli
from tests.brokerkit import ADMIN, AGENT, VIEWER, wait_until

# Trains 6 steps, its `scaled` module NaN from step 3 (an `event` rule, no park),
# then waits for the test to say stop.
JOB = """
    import os, sys, time
    import torch
    import breakpod

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.factor = 1.0

        def forward(self, h):
            return self.lin(h) * self.factor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), Scaled(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"name": "nan", "check": "nonfinite", "action": "event"}]
    monitor = breakpod.watch(model, rules, optimizer=opt, tier="detailed")  # per-module rows
    for step in range(6):
        model[1].factor = float("nan") if step == 3 else 1.0
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)
    print("trained", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
"""


def session_of(broker):
    with broker.client(VIEWER) as c:
        found = c.get("/v1/sessions").json()["sessions"]
    return found[0] if found else None


def events_of(broker, session_id, kind):
    with broker.client(VIEWER) as c:
        return c.get("/v1/events", params={"session": session_id, "kind": kind}).json()["events"]


def flight_cli(broker, target, token=ADMIN):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_BROKER_TOKEN": token}
    return run_cli("flight", target, "--timeout", "20", env=env, timeout=60)


def test_flight_asks_a_live_job_and_reads_an_ended_one_from_its_events(broker, spawn, tmp_path):
    stop = tmp_path / "stop"
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(JOB, env=env, args=[str(stop)], stdin="closed")
    session = wait_until(lambda: session_of(broker), timeout=60)
    anomaly = wait_until(lambda: events_of(broker, session["id"], "anomaly"), timeout=60)[0]
    carried = anomaly["fields"]["flight"]["first_bad"][0]
    assert (carried["module"], carried["phase"], carried["step"]) == ("1", "forward", 3)

    live = flight_cli(broker, session["id"])
    assert live.returncode == 0, live.stderr
    assert "flight recorder: steps 0-5 (6 kept)" in live.stdout, live.stdout
    first = live.stdout.split("first bad step per module")[1].splitlines()[1].split()
    assert first[:5] == ["1", "forward", "step", "3", "nan"], live.stdout

    stop.touch()
    assert child.wait(timeout=30) == 0
    wait_until(lambda: session_of(broker)["state"] == "finished", timeout=30)
    ended = flight_cli(broker, session["id"], token=VIEWER)  # no command: a viewer may read
    assert ended.returncode == 0, ended.stderr
    assert "(from its last log event)" in ended.stdout, ended.stdout
    assert "step 3" in ended.stdout and "steps 0-5 (6 kept)" in ended.stdout, ended.stdout
