"""A fused optimizer's update gate: a step whose gradients are NaN/Inf is skipped on the
device, with no host read, between the monitor's reads; a park's decision stands."""

from __future__ import annotations

import os

import pytest
import torch

import breakpod
from tests.agent.nets import Net, batch

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
BAD = 2  # the step whose backward makes NaN gradients


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    for var in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_MONITOR_TIER", "BREAKPOD_REPLAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("BREAKPOD_SKIP_ON_DEVICE", raising=False)


def train(optimizer_kind: str, *, replay: bool = False, steps: int = 5, scaler=None):
    """Adam steps under ``watch(optimizer=...)`` at check_every=10 (no read in between);
    per step: (parameters unchanged by its update, reads during its update)."""
    torch.manual_seed(0)
    model = Net()
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}[optimizer_kind]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, **kind)
    monitor = breakpod.watch(model, optimizer=optimizer, check_every=10, replay=replay)
    seen = []
    for step in range(steps):
        model.poison.mode = "backward" if step == BAD else None
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        before, reads = [p.detach().clone() for p in model.parameters()], monitor.reads
        scaler.step(optimizer) if scaler else optimizer.step()
        if scaler:
            scaler.update()
        same = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        seen.append((same, monitor.reads - reads))
        assert "found_inf" not in vars(optimizer)  # the gate's for one update only
    monitor.flush()
    return model, optimizer, monitor, seen


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_fused_optimizer_skips_a_nan_update_on_the_device_without_a_host_read():
    model, optimizer, monitor, seen = train("fused")
    assert seen[BAD] == (True, 0)  # untouched, and nothing read to decide it
    assert [same for same, _ in seen] == [False, False, True, False, False]
    assert finite(model)
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {4}  # Adam's step count did not move for the skipped update
    (anomaly, *_) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert anomaly.step == BAD and anomaly.skipped
    assert "fused optimizer's found_inf" in anomaly.details["skipped"]
    assert monitor.skipped_steps == 1
    monitor.close()


def test_an_optimizer_that_cannot_take_the_flag_applies_the_nan_update_as_before():
    model, _, monitor, seen = train("foreach")
    assert seen[BAD][0] is False and not finite(model)  # what the gate saves a fused one from
    assert not any(a.skipped for a in monitor.anomalies) and monitor.skipped_steps == 0
    monitor.close()


def test_a_step_judged_before_its_update_is_marked_skipped_too():
    """On a CPU the sentinel reads a step with a NaN gradient at its end (to replay it
    there): the finding exists before the update, and says the device skipped it."""
    model, _, monitor, seen = train("fused", replay=True)
    assert seen[BAD][0] is True and finite(model)
    bad = [a for a in monitor.anomalies if a.step == BAD and a.check == "nonfinite"]
    assert bad and all(a.skipped for a in bad) and monitor.skipped_steps == 1
    monitor.close()


def test_the_gate_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("BREAKPOD_SKIP_ON_DEVICE", "0")
    model, _, monitor, seen = train("fused")
    assert seen[BAD][0] is False and not finite(model)
    monitor.close()


def test_under_grad_scaler_the_scaler_decides_and_the_gate_stays_out():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, _, monitor, seen = train("fused", scaler=scaler)
    assert seen[BAD][0] is True and finite(model)
    assert scaler.get_scale() == 512.0  # the scaler saw its inf and backed off
    assert monitor.skipped_steps == 0  # the scaler's skip, not the gate's
    monitor.close()


PARKED_LOOP = """
    import torch, breakpod
    from tests.agent.nets import Net, batch
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    rules = [{"check": "nonfinite", "action": ["log", "break"]}]
    monitor = breakpod.watch(model, rules, optimizer=optimizer, check_every=10)
    for step in range(4):
        model.poison.mode = "backward" if step == 2 else None
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("finished", finite, monitor.skipped_steps)
"""


@pytest.mark.parametrize(("policy", "said"), [("continue", "False 0"), ("", "True 1")])
def test_a_park_decides_the_update_and_the_gate_does_not(spawn, policy, said):
    """The park's expiry policy is the update's fate: ``continue`` applies the NaN update
    even with a fused optimizer; by default a non-finite one is skipped (on the host)."""
    env = {"PYTHONPATH": ROOT, "BREAKPOD_HOLD_SECONDS": "0.2", "BREAKPOD_ON_EXPIRE": policy}
    child = spawn(PARKED_LOOP, env=env, stdin="closed")
    assert child.wait(timeout=60) == 0, child.stderr
    assert f"finished {said}" in child.stdout(), child.stderr
