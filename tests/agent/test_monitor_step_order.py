"""One step, one "before the update", whatever order the loop calls the monitor in.

The anomaly's step is the loop's step, the first bad module (or the batch) is
named, and ``skip`` drops the update before the optimizer applies it: with
``optimizer=`` and ``monitor.step(loss)`` before ``optimizer.step()`` (the
documented order), after it, ``record_loss`` before or after, without
``optimizer=``, and with gradient accumulation.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.nn import functional as F

import breakpod
from tests.agent.nets import Net, batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ORDERS = (
    "optimizer-step-before",  # the documented order
    "optimizer-step-after",
    "optimizer-record-before",
    "optimizer-record-after",
    "no-optimizer-step-before",
    "optimizer-accumulate",
)


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def _train(order: str, fault: str, at: int, steps: int = 9) -> tuple[breakpod.Monitor, bool]:
    """``steps`` SGD steps in ``order`` with ``fault`` injected at step ``at``; a skip rule."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "nan", "check": "nonfinite", "action": ["log", "skip"]}]
    hooked = order.startswith("optimizer")
    monitor = breakpod.watch(model, rules, optimizer=opt if hooked else None)
    micro = 2 if order == "optimizer-accumulate" else 1
    for step in range(steps):
        opt.zero_grad()
        if fault == "weight" and step == at:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")
        for m in range(micro):
            x, y = batch(step * micro + m)
            if fault == "batch" and step == at and m == micro - 1:
                x[0, 0] = float("nan")
            loss = F.cross_entropy(model(x), y)
            if fault == "loss" and step == at:
                loss = loss * float("nan")
            (loss / micro).backward()
            if order in ("optimizer-step-before", "no-optimizer-step-before"):
                monitor.step(loss)
            elif order in ("optimizer-record-before", "optimizer-accumulate"):
                monitor.record_loss(loss)
        opt.step()
        if order == "optimizer-step-after":
            monitor.step(loss)
        elif order == "optimizer-record-after":
            monitor.record_loss(loss)
    monitor.flush()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    monitor.close()
    return monitor, finite


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_batch_is_the_loops_step_names_the_batch_and_is_skipped(order):
    monitor, finite = _train(order, "batch", 7)
    (a,) = monitor.anomalies
    assert (a.step, a.phase, a.module, a.details.get("batch")) == (7, "input", "fc1", True), a
    assert a.skipped and monitor.skipped_steps == 1 and finite
    assert monitor.step_count == 9


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_weight_is_named_at_its_module_and_step(order):
    monitor, _ = _train(order, "weight", 5)
    (a,) = [a for a in monitor.anomalies if a.step == 5]
    assert (a.phase, a.module) == ("forward", "fc2"), a
    assert "fc2.weight" in a.details["nonfinite_params"]
    assert min(a.step for a in monitor.anomalies) == 5


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_loss_is_judged_at_its_step_before_the_update(order):
    monitor, finite = _train(order, "loss", 5)
    (a,) = monitor.anomalies
    # a loss given after the update is late, but its NaN gradients are not
    late = order.endswith("after")
    assert (a.step, a.phase) == ((5, "backward") if late else (5, "loss")), a
    assert a.skipped and finite


def test_without_optimizer_a_step_after_the_update_never_claims_a_skip(capfd):
    """monitor.step() after optimizer.step() without optimizer=: the update is applied
    already; breakpod says so rather than "update skipped"."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "nan", "check": "nonfinite", "action": "skip"}]
    monitor = breakpod.watch(model, rules)
    for step in range(4):
        x, y = batch(step)
        if step == 2:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)
    (a,) = monitor.anomalies
    assert a.step == 2 and not a.skipped and monitor.skipped_steps == 0
    err = capfd.readouterr().err
    assert "update skipped" not in err
    assert "step 2: update not skipped: optimizer.step() ran before monitor.step()" in err


@pytest.mark.parametrize("set_to_none", [True, False])
def test_an_update_the_loop_skipped_itself_never_costs_the_next_step_its_update(capfd, set_to_none):
    """The loop skips the update of a NaN step itself (as GradScaler does): the step ends
    at the next backward, where a ``skip`` rule dropped the gradients it found, which were
    the next step's. That update was lost, and the step it ended had no gradients, so the
    sentinel took the job for an inference job and kept the detailed tier on for good.
    Gradients zeroed in place (``set_to_none=False``) hid the skipped step: the next
    backward's norms replaced its NaN ones, and the NaN was never reported."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"name": "nan", "check": "nonfinite", "action": "skip"}]
    monitor = breakpod.watch(model, rules, optimizer=opt)
    moved = []
    for step in range(6):
        x, y = batch(step)
        if step == 2:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        if torch.isfinite(loss):
            opt.step()
        now = list(model.parameters())
        moved.append(any(bool((p != b).any()) for p, b in zip(now, before, strict=True)))
    monitor.close()
    assert moved == [True, True, False, True, True, True]
    (a,) = monitor.anomalies
    assert (a.step, a.module, a.phase, a.skipped) == (2, "fc1", "input", True), a
    assert monitor.skipped_steps == 0  # the loop skipped it, not the monitor
    err = capfd.readouterr().err
    assert "update skipped" not in err
    assert "detailed tier is on" not in err, err


def test_an_evaluation_pass_after_the_update_keeps_a_late_loss_on_its_step():
    """A no_grad pass between optimizer.step() and monitor.step(loss) is not a new step."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rules = [{"check": "nonfinite", "action": "log"}]
    monitor = breakpod.watch(model, rules, optimizer=opt)
    for step in range(4):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model(x)
        monitor.step(loss.detach() * float("nan") if step == 2 else loss)
    monitor.flush()
    assert [(a.step, a.phase) for a in monitor.anomalies] == [(2, "loss")]


BREAK_IN_LOOP = """
    import torch
    import breakpod
    from torch.nn import functional as F
    from tests.agent.nets import Net, batch

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": ["log", "break"]}],
                             optimizer=opt)
    for step in range(7):
        x, y = batch(step)
        if step == 4:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        monitor.step(loss)
        opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("finished", finite, [(a.step, a.phase, a.skipped) for a in monitor.anomalies])
"""


@pytest.mark.timeout(120)
def test_an_interactive_break_in_the_documented_order_is_the_loops_step(spawn, pdb_client):
    child = spawn(BREAK_IN_LOOP, env={"PYTHONPATH": ROOT}, stdin="closed")
    client = pdb_client(child.park_port(timeout=60))
    banner = client.read_until()
    assert "anomaly: step 4 input fc1" in banner, banner
    assert re.search(r"-> opt\.step\(\)", banner), banner
    assert client.command("p step, anomaly.step").strip() == "(4, 4)"
    finite = "all(bool(torch.isfinite(p).all()) for p in model.parameters())"
    assert client.command(f"p {finite}").strip() == "True"  # before the update
    client.send("skip")
    assert "update will be skipped" in client.read_all()
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished True [(4, 'input', True)]" in child.stdout(), child.stderr
