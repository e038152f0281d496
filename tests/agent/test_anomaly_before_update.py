"""Anomalies are judged before optimizer.step() applies them: park, skip, expire, stop."""

from __future__ import annotations

import os
import re

import pytest
import torch

import breakpod
from tests.agent.nets import Net, batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# A gradient made NaN inside backward at step 4; the optimizer's pre-hook ends
# each step, and the user also calls monitor.step(loss) after opt.step().
BACKWARD_NAN = """
    import torch
    import breakpod
    from tests.agent.nets import Net, batch

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "nan-break", "check": "nonfinite", "action": ACTIONS}]
    monitor = breakpod.watch(model, rules, optimizer=opt)
    for step in range(8):
        model.poison.mode = "backward" if step == 4 else None
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    found = [(a.rule, a.step, a.skipped) for a in monitor.anomalies]
    print("finished", monitor.step_count, finite, monitor.skipped_steps, found)
"""


def backward_nan(actions: list[str]) -> str:
    return BACKWARD_NAN.replace("ACTIONS", repr(actions))


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.delenv("BREAKPOD_ON_EXPIRE", raising=False)
    torch.manual_seed(0)


@pytest.mark.timeout(120)
def test_break_parks_before_the_update_in_the_loop_and_skip_drops_it(spawn, pdb_client):
    child = spawn(backward_nan(["log", "break"]), env={"PYTHONPATH": ROOT}, stdin="closed")
    client = pdb_client(child.park_port(timeout=60))
    banner = client.read_until()
    assert "anomaly: step 4 backward" in banner and "[nan-break]" in banner, banner
    assert re.search(r"child\d+\.py\(\d+\)<module>\(\)\n-> opt\.step\(\)", banner), banner
    finite = "all(bool(torch.isfinite(p).all()) for p in model.parameters())"
    assert client.command(f"p {finite}").strip() == "True"  # the previous step's weights
    assert client.command("p step, anomaly.step, type(model).__name__").strip() == "(4, 4, 'Net')"
    assert client.command("p bool(torch.isnan(model.fc1.weight.grad).any())").strip() == "True"
    where = client.command("where")
    assert "opt.step()" in where and "torch/optim" not in where and "hidden" in where
    assert "torch/optim" in client.command("where all")
    client.send("skip")
    assert "update will be skipped" in client.read_all()
    assert child.wait(timeout=60) == 0
    assert "finished 8 True 1 [('nan-break', 4, True)]" in child.stdout(), child.stderr


@pytest.mark.timeout(120)
def test_an_expired_hold_can_skip_or_exit_with_a_distinct_status(spawn):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_HOLD_SECONDS": "0.2", "BREAKPOD_ON_EXPIRE": "skip"}
    child = spawn(backward_nan(["break"]), env=env, stdin="closed")
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished 8 True 1 [('nan-break', 4, True)]" in child.stdout()
    child = spawn(backward_nan(["break"]), env={**env, "BREAKPOD_ON_EXPIRE": "exit"})
    assert child.wait(timeout=60) == 75
    assert "exiting with status 75" in child.stderr and "finished" not in child.stdout()


@pytest.mark.timeout(120)
def test_break_and_stop_with_post_mortem_hold_once(spawn, pdb_client):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_POST_MORTEM": "1"}
    script = backward_nan(["break", "stop"]).replace(
        "import breakpod\n", "import breakpod\n    breakpod.install_excepthook()\n"
    )
    child = spawn(script, env=env, stdin="closed")
    client = pdb_client(child.park_port(timeout=60))
    assert "anomaly: step 4" in client.read_until()
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 1
    assert child.stderr.count("waiting up to") == 1, child.stderr
    assert "AnomalyError" in child.stderr and "exiting with status 1" in child.stderr


def test_skip_action_drops_the_nan_loss_step_without_parking():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "skip-nan", "check": "nonfinite", "action": ["log", "skip"]}]
    monitor = breakpod.watch(model, rules)
    for step in range(8):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 5:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        monitor.step(loss)  # before opt.step(): the verdict comes first
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert unchanged == (step == 5), step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ((a),) = monitor.anomalies
    assert (a.rule, a.step, a.phase, a.skipped) == ("skip-nan", 5, "loss", True)
    assert monitor.skipped_steps == 1
    assert "1 skipped steps" in breakpod.summary(monitor)


def test_steps_count_once_with_the_optimizer_hook_and_monitor_step():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, optimizer=opt)
    for step in range(6):
        model.poison.mode = "backward" if step == 4 else None
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)
    assert monitor.step_count == 6
    (a,) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert a.step == 4 and str(a).startswith("step 4 ")


def test_a_user_rule_replaces_the_default_and_two_rules_on_one_tensor_give_one_line(capfd):
    model = Net()
    rules = [
        {"name": "mine", "check": "nonfinite", "action": "log"},
        {"name": "poison-only", "check": "nonfinite", "modules": "poison", "action": "log"},
    ]
    monitor = breakpod.watch(model, rules)
    model.poison.mode = "forward"
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    monitor.step()
    (a,) = monitor.anomalies
    assert (a.rule, a.also, a.module) == ("mine", ["poison-only"], "poison")
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "anomaly:" in ln]
    assert len(lines) == 1 and "[mine, poison-only]" in lines[0], lines


def test_healthy_run_reads_once_per_step_with_a_break_rule_and_never_parks():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "b", "check": "nonfinite", "action": "break"}]
    monitor = breakpod.watch(model, rules, optimizer=opt, check_every=10)
    for step in range(30):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert monitor.step_count == 30 and monitor.reads == 30 and not monitor.anomalies


@pytest.mark.parametrize("loss_first", [True, False], ids=["loss-before-update", "loss-after"])
def test_a_skip_drops_its_own_steps_update_or_none(loss_first, capfd):
    """With optimizer=, a loss given after opt.step() is judged once its update is applied:
    a skip then cannot drop it, and must not drop the next step's good update instead."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"check": "loss_spike", "action": "skip", "min_history": 3}]
    monitor = breakpod.watch(model, rules, config={"defaults": False}, optimizer=opt)
    changed = []
    for step in range(7):
        x = torch.randn(8, 4) * (100 if step == 4 else 1)  # step 4: a spike
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if loss_first:
            monitor.record_loss(loss)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        after = model.parameters()
        changed.append(not all(torch.equal(a, p) for a, p in zip(before, after, strict=True)))
        if not loss_first:
            monitor.step(loss)
    monitor.flush()
    ((a),) = monitor.anomalies
    assert (a.step, a.skipped) == (4, loss_first)
    assert changed == [step != 4 or not loss_first for step in range(7)]
    said = "step 4: update not skipped: it was applied before the anomaly was found"
    assert (said in capfd.readouterr().err) == (not loss_first)
