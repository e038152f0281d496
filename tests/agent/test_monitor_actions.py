"""Actions: break parks in a remote pdb, snapshot, stop, event, callables."""

from __future__ import annotations

import re

import pytest
import torch

import breakpod
from breakpod._core import events
from tests.agent.nets import Net, train

BREAK_SCRIPT = """
    import torch
    import breakpod
    from tests.agent.nets import Net, train

    torch.manual_seed(0)
    model = Net()
    rules = [{"name": "nan-break", "check": "nonfinite", "action": ["log", "break"]}]
    monitor = breakpod.watch(model, rules)

    def before(step):
        model.poison.mode = "forward" if step == 3 else None

    train(model, monitor, 8, before=before, lr=0.0)
    print("finished", monitor.step_count, [(a.rule, a.step, a.module) for a in monitor.anomalies])
"""

BROKER_BREAK_SCRIPT = """
    import torch
    import breakpod
    from breakpod._link import emitter
    from tests.agent.nets import Net, batch

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, optimizer=optimizer)  # the optimizer's hook ends each step
    for step in range(3):
        if step == 1:
            emitter.request_break()  # what `breakpod send ID break` does
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the boundary
    print("finished", monitor.step_count)
"""


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def test_break_parks_with_the_anomaly_in_scope_and_training_goes_on(spawn, pdb_client):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    child = spawn(BREAK_SCRIPT, env={"PYTHONPATH": root})
    client = pdb_client(child.park_port(timeout=30))
    banner = client.read_until()
    assert "anomaly: step 3 forward poison: [nan-break]" in banner
    assert "-> monitor.step(loss)" in banner  # the training loop's frame (nets.train)
    stat = client.command("tstat anomaly.tensor")
    assert re.search(r"tensor\[32,16\] f32 cpu 2.0Kb nan=0 inf=512", stat), stat
    assert (
        client.command("p step, anomaly.rule, type(model.poison).__name__").strip()
        == "(3, 'nan-break', 'Poison')"
    )
    assert "poison: ([32, 16]) -> [32, 16]" in client.command("tshape monitor")
    assert "reported: step 3 forward poison" in client.command("tnan monitor")
    grads = client.command("tgrad monitor")
    assert "fc1.weight: |grad|=" in grads
    assert "shard" not in grads, grads  # a whole tensor is not called one
    assert "RSS" in client.command("tmem")
    client.send("c")
    assert "continuing" in client.read_all()
    assert child.wait(timeout=30) == 0
    out = child.stdout()
    assert "finished 8" in out and "('nan-break', 3, 'poison')" in out


def test_snapshot_saves_the_offending_tensor_and_stats(tmp_path):
    model = Net()
    rules = [{"name": "snap", "check": "nonfinite", "action": "snapshot"}]
    monitor = breakpod.watch(model, rules, snapshot_dir=tmp_path)
    model.poison.mode = "forward"
    train(model, monitor, 1)
    (a,) = [a for a in monitor.anomalies if a.rule == "snap"]
    saved = torch.load(a.details["snapshot"], weights_only=False)
    assert saved["anomaly"]["module"] == "poison" and saved["anomaly"]["step"] == 0
    assert saved["tensor"].shape == (32, 16) and torch.isneginf(saved["tensor"]).all()
    assert a.details["-inf"] == 512 and a.value == 512  # exact counts when the tensor was kept


def test_stop_raises_a_clear_error_into_the_training_loop():
    model = Net()
    monitor = breakpod.watch(model, [{"name": "halt", "check": "nonfinite", "action": "stop"}])
    model.poison.mode = "forward"
    with pytest.raises(breakpod.AnomalyError, match=r"rule|halt") as info:
        train(model, monitor, 1)
    assert "step 0 forward poison: [halt]" in str(info.value)
    assert info.value.anomaly.module == "poison"


def test_stop_on_a_shape_contract_raises_from_the_forward_itself():
    model = Net()
    rules = [
        {"name": "hid", "check": "shape", "modules": "fc1", "expect": "B,99", "action": "stop"}
    ]
    monitor = breakpod.watch(model, rules)
    with pytest.raises(breakpod.AnomalyError, match="fc1"):
        model(torch.randn(2, 8))
    assert monitor.anomalies[0].details == {"expected": "(B, 99)", "actual": [2, 16]}


def test_event_action_publishes_on_the_hub_and_the_sink():
    model = Net()
    seen: list[events.Event] = []
    sunk: list[breakpod.Anomaly] = []
    events.add_sink(seen.append)
    try:
        rules = [{"name": "ev", "check": "nonfinite", "action": "event"}]
        monitor = breakpod.watch(model, rules, sink=sunk.append)
        model.poison.mode = "forward"
        train(model, monitor, 1)
    finally:
        events.remove_sink(seen.append)
    (event,) = [e for e in seen if e.kind == "anomaly" and e.fields["rule"] == "ev"]
    assert event.fields["module"] == "poison"
    assert event.fields["phase"] == "forward" and "tensor" not in event.fields
    assert [a.rule for a in sunk] == ["ev"]  # it replaces the default rule of its check


def test_a_callable_action_and_a_failing_one_never_stop_training():
    model = Net()
    calls: list[str] = []

    def boom(anomaly: breakpod.Anomaly) -> None:
        raise RuntimeError("sink down")

    rules = [
        {"name": "cb", "check": "nonfinite", "action": [lambda a: calls.append(a.module), boom]}
    ]
    monitor = breakpod.watch(model, rules)
    model.poison.mode = "forward"
    train(model, monitor, 2)
    assert calls == ["poison"] and monitor.step_count == 2
    assert monitor.errors == 1  # the failing action counts, as a failing hook would
    assert "1 errors" in monitor.summary_line()


def test_a_broker_break_parks_in_the_training_loop_not_in_torch(spawn, pdb_client):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    child = spawn(BROKER_BREAK_SCRIPT, env={"PYTHONPATH": root})
    client = pdb_client(child.park_port(timeout=30))
    banner = client.read_until()
    assert "break requested through the broker" in banner
    # the loop's optimizer.step() line, held before the update, not torch's optimizer wrapper
    assert re.search(r"child\d+\.py\(\d+\)<module>\(\)\n-> optimizer.step\(\)", banner), banner
    assert client.command("p step, monitor.step_count").strip() == "(1, 2)"
    client.send("c")
    client.read_all()
    assert child.wait(timeout=30) == 0 and "finished 3" in child.stdout()


def test_the_break_frame_skips_torch_and_breakpod_frames(monkeypatch):
    from breakpod._debug import breakpoints
    from breakpod._link import emitter

    parked = []
    monkeypatch.setattr(breakpoints, "hold", lambda frame, header: parked.append(frame))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, optimizer=optimizer)
    emitter.request_break()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    (frame,) = parked
    assert frame.f_code is test_the_break_frame_skips_torch_and_breakpod_frames.__code__
    monitor.close()
