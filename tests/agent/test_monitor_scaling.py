"""Under GradScaler (real torch.amp.GradScaler on CPU): its overflows are its own business,
and a NaN the scaling does not explain is still reported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import breakpod
from breakpod._monitor.scaling import IN_A_ROW
from tests.agent.nets import Net, batch, train_skipping_nan

# so large that the first scaled losses overflow: the scaler backs off for a few steps
OVERFLOWING = 3.0e38


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    for var in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_MONITOR_TIER", "BREAKPOD_REPLAY"):
        monkeypatch.delenv(var, raising=False)


def train_scaled(
    steps: int,
    *,
    fused: bool,
    poison: str | None = None,
    at: Callable[[int], bool] = lambda step: False,
    scale: float = 2.0**16,
    set_to_none: bool = True,
):
    """fp16-style steps: scaler.scale(loss).backward(), scaler.step, scaler.update; the
    model is poisoned (``poison``) at the steps ``at`` picks."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    monitor = breakpod.watch(model, optimizer=optimizer)
    for step in range(steps):
        model.poison.mode = poison if at(step) else None
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss * 100).backward()
        scaler.step(optimizer)
        scaler.update()
        monitor.step(loss)
    monitor.flush()
    return model, scaler, monitor


@pytest.mark.parametrize("fused", [True, False])
def test_a_scalers_overflows_are_said_once_and_not_reported(fused, capfd):
    model, scaler, monitor = train_scaled(12, fused=fused, scale=OVERFLOWING)
    assert scaler.get_scale() < OVERFLOWING / 2  # the scaler did back off
    assert monitor.anomalies == [] and monitor.errors == 0
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    err = capfd.readouterr().err
    assert err.count("GradScaler overflow") == 1, err
    assert "not an anomaly, unless it lasts 16 steps" in err
    monitor.close()


def test_a_long_runs_routine_overflows_are_said_ever_more_rarely(capfd):
    """Eight one-step overflows (a backward NaN the scaler skips): said at the 1st, 2nd,
    4th and 8th, none reported."""
    _, _, monitor = train_scaled(26, fused=True, poison="backward", at=lambda step: step % 3 == 2)
    assert monitor.anomalies == [] and monitor.errors == 0
    said = [line for line in capfd.readouterr().err.splitlines() if "GradScaler overflow" in line]
    assert [line.split(": ")[2] for line in said] == [
        "step 2",
        "step 5",
        "step 11",
        "step 23",
    ], said
    assert "GradScaler overflow, the 8th so far" in said[-1]
    monitor.close()


@pytest.mark.parametrize("fused", [True, False])
def test_a_nan_the_scaling_does_not_explain_is_reported_once_it_outlasts_the_scaler(fused):
    """A backward that makes NaN whatever the scale: the scaler skips every update. A
    for-loop optimizer never steps then: each skipped step ends at the next backward."""
    _, scaler, monitor = train_scaled(
        IN_A_ROW + 8, fused=fused, poison="backward", at=lambda step: step >= 4
    )
    assert scaler.get_scale() < 2.0**16 / 2**IN_A_ROW  # it skipped and backed off each time
    (a,) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert a.phase == "backward" and a.step == 4, a
    assert "held as a GradScaler overflow from step 4" in a.details["loss_scaling"]
    assert f"non-finite for {IN_A_ROW} steps whatever the scale" in a.details["loss_scaling"]
    monitor.close()


def test_a_nan_in_the_forward_is_reported_at_its_step_under_a_scaler():
    _, _, monitor = train_scaled(8, fused=True, poison="forward", at=lambda step: step >= 4)
    found = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert [(a.step, a.module, a.how) for a in found] == [(4, "poison", "replay")], found
    assert "loss_scaling" not in found[0].details
    monitor.close()


def test_with_optimizer_a_step_whose_update_the_loop_skips_is_still_a_step():
    """A loop's own skip of a NaN step (no optimizer.step(), so no hook): that step ends
    at the next backward, is reported at its own number, and the numbers stay the loop's."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, optimizer=optimizer)
    assert train_skipping_nan(model, optimizer, 6, 2) == [True, True, False, True, True, True]
    monitor.flush()
    found = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert [(a.step, a.module, a.how) for a in found] == [(2, "poison", "replay")], found
    assert monitor.step_count == 6 and monitor.errors == 0
    monitor.close()


def test_a_scalers_skips_stay_steps_when_zero_grad_zeroes_in_place():
    """``zero_grad(set_to_none=False)`` keeps the gradient tensors, so a skipped update
    looks like accumulation there; the scaler's update() between the two backwards tells
    it was a step (accumulation calls no update()). The step numbers stay the loop's."""
    _, _, monitor = train_scaled(
        12, fused=False, poison="backward", at=lambda step: step in (2, 7), set_to_none=False
    )
    assert monitor.step_count == 12 and monitor.anomalies == [] and monitor.errors == 0
    monitor.close()


def test_accumulated_gradients_are_one_step_and_no_skip():
    """Two backwards into the same gradients before each update: one step each."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, optimizer=optimizer)
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):
            x, y = batch(2 * step + micro)
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert monitor.step_count == 4 and monitor.anomalies == [] and monitor.errors == 0
    monitor.close()
