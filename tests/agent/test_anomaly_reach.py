"""Every anomaly reaches the event hub whatever the rule's actions; an expired hold
after a non-finite step skips that update unless BREAKPOD_ON_EXPIRE=continue."""

from __future__ import annotations

import os
import re

import pytest
import torch

import breakpod
from breakpod import protocol
from breakpod._core import events
from tests.agent.nets import Net, batch
from tests.agent.test_flight_cli import events_of, flight_cli, session_of
from tests.brokerkit import AGENT, VIEWER, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# The README's example: a NaN sample at step 7, a [log, break] rule, nobody attaches.
README_LOOP = """
    import torch, breakpod
    from breakpod._core import events

    seen = []
    events.add_sink(lambda e: seen.append(e))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"check": "nonfinite", "action": ["log", "break"]}]
    monitor = breakpod.watch(model, rules, tier="detailed")  # the flight's per-module rows
    for step in range(10):
        x = torch.randn(32, 16)
        x[3, 5] = float("nan") if step == 7 else x[3, 5]
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad(); loss.backward(); monitor.step(loss)
        optimizer.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    anomalies = [e for e in seen if e.kind == "anomaly"]
    flight = bool(anomalies) and "flight" in anomalies[0].fields
    print("finished", finite, monitor.skipped_steps, len(anomalies), flight)
"""


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def test_a_rule_without_event_still_emits_the_anomaly_event():
    seen: list[events.Event] = []
    events.add_sink(seen.append)
    sunk = []
    try:
        model = Net()
        rules = [{"name": "quiet", "check": "nonfinite", "action": ["log"]}]
        monitor = breakpod.watch(model, rules, sink=sunk.append)
        model.poison.mode = "forward"
        x, y = batch(0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        monitor.step()
        monitor.close()
    finally:
        events.remove_sink(seen.append)
    (event,) = [e for e in seen if e.kind == protocol.ANOMALY]
    assert (event.fields["rule"], event.fields["module"]) == ("quiet", "poison")
    assert [a.rule for a in sunk] == ["quiet"]


@pytest.mark.timeout(120)
def test_the_readme_example_expires_skips_the_nan_update_and_sends_its_event(spawn):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_HOLD_SECONDS": "0.2"}
    child = spawn(README_LOOP, env=env, stdin="closed")
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished True 1 1 True" in child.stdout(), child.stderr
    said = "step 7's update will be skipped (its values are non-finite; BREAKPOD_ON_EXPIRE=continue"
    assert said in child.stderr, child.stderr


@pytest.mark.timeout(120)
def test_on_expire_continue_keeps_applying_the_update(spawn):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_HOLD_SECONDS": "0.2", "BREAKPOD_ON_EXPIRE": "continue"}
    child = spawn(README_LOOP, env=env, stdin="closed")
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished False 0 1 True" in child.stdout(), child.stderr


@pytest.mark.timeout(180)
def test_a_log_break_rule_reaches_the_broker_with_its_flight_dump(broker, spawn):
    """The README's rule, [log, break], nobody attaching: the broker has the anomaly, and
    `breakpod flight SESSION` reads its dump once the job has ended."""
    env = {
        "PYTHONPATH": ROOT,
        "BREAKPOD_HOLD_SECONDS": "0.2",
        "BREAKPOD_BROKER_URL": broker.url,
        "BREAKPOD_AGENT_TOKEN": AGENT,
    }
    child = spawn(README_LOOP, env=env, stdin="closed")
    assert child.wait(timeout=90) == 0, child.stderr
    session = wait_until(lambda: session_of(broker), timeout=30)
    (anomaly,) = wait_until(lambda: events_of(broker, session["id"], protocol.ANOMALY), timeout=30)
    assert anomaly["fields"]["step"] == 7 and anomaly["fields"]["flight"], anomaly
    ended = flight_cli(broker, session["id"], token=VIEWER)
    assert ended.returncode == 0, ended.stderr
    assert "(from its last" in ended.stdout, ended.stdout
    assert re.search(r"<batch> +input +step 7  nan", ended.stdout), ended.stdout
