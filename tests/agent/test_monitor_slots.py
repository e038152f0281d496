"""The slot table: one kernel per statistic into a reused buffer, vector judgement on the host."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import breakpod
from bench.monitors import launches  # the bench's count of kernel launches
from breakpod._monitor import checks, stats
from breakpod._monitor.flight import recorder as flight
from tests.agent.nets import Net, batch, train


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "detailed")  # the per-module hooks' tests


def mlp(modules: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(modules // 2):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers)


def ops_per_step(model: nn.Module, monitor: object = None, steps: int = 2) -> float:
    """Torch ops that launch a kernel (on a GPU), per training step."""
    x = torch.randn(8, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if monitor is not None:
            monitor.step(loss)  # type: ignore[attr-defined]

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    top = launches(prof.events())
    return len(top) / steps


def added_ops(modules: int, seen: list[int] | None = None) -> float:
    torch.manual_seed(0)
    plain = ops_per_step(mlp(modules))
    torch.manual_seed(0)
    model = mlp(modules)
    monitor = breakpod.watch(model)
    added = ops_per_step(model, monitor) - plain
    assert monitor.errors == 0 and monitor.step_count == 3
    if seen is not None and monitor.flight is not None:  # the tensors that were seen
        seen.append(sum(s.phase != "loss" for s in monitor.flight.dump().series))
    monitor.close()
    return added


def test_the_default_rules_add_at_most_two_kernels_per_watched_module_per_step(monkeypatch):
    """Non-finite: a kernel per Linear output and input gradient; dead units: two per ReLU
    (a per-unit max over the batch, then the count of live units). Plus a few per step.
    (The flight recorder's own kernels are counted by the next test.)"""
    monkeypatch.setenv(flight.FLIGHT_ENV, "0")
    small, large = added_ops(100), added_ops(300)
    per_module = (large - small) / 200
    assert per_module <= 2, f"{per_module:.2f} ops added per watched module per step"
    # per step: blocks reduced, gradient norms, the read (18 here; the judgement runs on
    # host copies, and ``launches`` leaves it out)
    assert small - 100 * per_module <= 40, f"{small:.0f} ops added per step for 100 modules"


def test_the_flight_recorder_adds_kernels_per_block_not_per_tensor(monkeypatch):
    """``|x|_2``, min and max are three more reductions per staged block (a block holds
    up to 256 of these small tensors), plus a ring copy per device and one for the loss
    per step: nothing per watched tensor."""
    monkeypatch.setenv(flight.FLIGHT_ENV, "0")
    without = added_ops(100), added_ops(300)
    monkeypatch.setenv(flight.FLIGHT_ENV, "64")
    slots: list[int] = []
    recorded = added_ops(100, slots), added_ops(300)
    extra = [r - w for r, w in zip(recorded, without, strict=True)]
    assert slots[0] >= 150  # the tensors it recorded: outputs and input gradients
    assert extra[0] <= 3 * 4 + 2, (recorded, without)
    assert (extra[1] - extra[0]) / 200 <= 0.1, (recorded, without)


def test_healthy_steps_build_no_per_module_sample(monkeypatch):
    """Slots are judged as vectors: a Python sample is made only for what is flagged."""
    made = []
    real = stats.Sample

    def counting(*args, **kwargs):
        made.append(args[0].module)
        return real(*args, **kwargs)

    monkeypatch.setattr(stats, "Sample", counting)
    model = mlp(100)
    monitor = breakpod.watch(model)
    x = torch.randn(8, 16) + 0.5
    for _ in range(5):
        loss = model(x).pow(2).mean()
        loss.backward()
        monitor.step(loss)
    monitor.flush()
    assert monitor.step_count == 5 and monitor.errors == 0
    assert made == []
    with torch.no_grad():
        model[0].bias.fill_(float("nan"))
    model(x).pow(2).mean().backward()
    monitor.step()
    monitor.flush()
    assert made and set(made) <= {m for m, _ in model.named_children()}
    (a,) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert a.module == "0"
    monitor.close()


class Twice(nn.Module):
    """Runs its layer twice per forward (as micro-batches do per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.poison_first = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.fc(x * float("inf") if self.poison_first else x)
        return self.fc(x) + first.detach() * 0


def test_a_module_called_twice_in_a_step_keeps_the_first_calls_nonfinite():
    model = Twice()
    monitor = breakpod.watch(model)
    x = torch.randn(4, 8)
    for step in range(3):
        model.poison_first = step == 2
        model(x).sum().backward()
        monitor.step()
    monitor.flush()
    bad = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert bad and (bad[0].step, bad[0].module) == (2, "fc")


def test_a_dead_streak_that_breaks_is_cleared_though_the_slot_looks_fine():
    """Mid-streak slots are examined even when healthy, so ``consecutive`` stays exact."""
    model = Net()
    rules = [{"name": "dead", "check": "dead_units", "modules": "act2", "consecutive": 3}]
    monitor = breakpod.watch(model, {"rules": rules, "defaults": False})
    dead_steps = {0, 1, 3, 4, 6, 7, 8}  # streaks of 2, 2, then 3

    def before(step: int) -> None:
        with torch.no_grad():
            model.fc2.bias.fill_(-1e3 if step in dead_steps else 1e3)

    train(model, monitor, 9, lr=0.0, before=before)
    monitor.flush()
    dead = [a.step for a in monitor.anomalies if a.check == "dead_units"]
    assert dead == [8]
    monitor.close()


def test_check_every_reads_every_step_of_the_buffer():
    """The buffer is reused each step; every step's values still reach the detector."""
    model = Net()
    monitor = breakpod.watch(model, check_every=5)
    for step in range(10):
        model.poison.mode = "forward" if step in (2, 7) else None
        model.zero_grad()
        model(batch(step)[0]).sum().backward()
        monitor.step()
    monitor.flush()
    bad = [(a.step, a.module) for a in monitor.anomalies if a.check == "nonfinite"]
    assert bad == [(2, "poison"), (7, "poison")]
    monitor.close()


@pytest.mark.parametrize("shape", [(8, 16), (4, 6, 5, 5), (3, 7, 16), (2, 4, 3, 3, 3)])
def test_live_units_are_counted_alike_by_every_reduction(shape):
    """The CPU's per-unit sum |x| and a ReLU's plain max count what max |x| counts,
    dead units, NaN and Inf included."""
    from breakpod._monitor import checks

    torch.manual_seed(0)
    x = torch.randn(*shape)
    unit = (slice(None), 1) if len(shape) != 3 else (..., 1)
    x[unit] = 0.0  # a dead unit
    x.view(-1)[0], x.view(-1)[-1] = float("nan"), float("-inf")
    relu = torch.relu(x)
    reference = torch.linalg.vector_norm(
        torch.linalg.vector_norm(x, float("inf"), dim=checks.batch_dims(x.dim())), 0
    )
    reference_relu = torch.linalg.vector_norm(
        torch.linalg.vector_norm(relu, float("inf"), dim=checks.batch_dims(x.dim())), 0
    )
    dims = checks.batch_dims(x.dim())

    def live(t: torch.Tensor, nonnegative: bool = False) -> torch.Tensor:
        return torch.linalg.vector_norm(checks.unit_maxima(t, dims, False, nonnegative), 0)

    assert live(x) == reference < checks.unit_count(shape)
    assert live(relu) == live(relu, nonnegative=True) == reference_relu < checks.unit_count(shape)


def test_dead_units_are_measured_on_the_steps_that_are_read():
    """check_every=3: the slow conditions are measured at steps 2, 5, 8, ... and
    ``consecutive`` counts those measurements (non-finite values: every step)."""
    model = Net()
    rules = [{"name": "dead", "check": "dead_units", "modules": "act2", "consecutive": 3}]
    monitor = breakpod.watch(model, {"rules": rules, "defaults": False}, check_every=3)

    def before(step: int) -> None:
        with torch.no_grad():
            model.fc2.bias.fill_(-1e3)  # every unit of act2 dead from the first step

    train(model, monitor, 12, lr=0.0, before=before)
    monitor.flush()
    assert [a.step for a in monitor.anomalies if a.check == "dead_units"] == [8]
    monitor.close()


def test_steps_between_reads_skip_the_activation_statistics(monkeypatch):
    """Per-unit reductions (dead units) run on read steps only, staged and direct alike."""
    measured: list[int] = []
    real = checks.unit_maxima

    def counting(*args, **kwargs):
        measured.append(monitor.step_count)
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "unit_maxima", counting)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2048), nn.ReLU())
    monitor = breakpod.watch(model, check_every=4)
    x = torch.randn(32, 16)  # the second ReLU's 65,536 values take the direct path
    for _ in range(8):
        model(x).sum().backward()
        monitor.step()
    assert sorted(set(measured)) == [3, 7] and len(measured) >= 4
    monitor.flush()
    assert monitor.errors == 0
    monitor.close()


def test_a_step_between_reads_without_the_flight_recorder_still_checks(monkeypatch):
    """Without the flight recorder a ReLU's slot has only its dead-unit column, which a
    step between reads skips: its block has nothing to compute, and nothing breaks."""
    monkeypatch.setenv(flight.FLIGHT_ENV, "0")
    model = Net()
    monitor = breakpod.watch(model, check_every=3)
    for step in range(7):
        model.poison.mode = "forward" if step == 4 else None
        model.zero_grad()
        model(batch(step)[0]).sum().backward()
        monitor.step()
    monitor.flush()
    assert monitor.errors == 0 and monitor.step_count == 7
    bad = [(a.step, a.module) for a in monitor.anomalies if a.check == "nonfinite"]
    assert bad == [(4, "poison")]
    monitor.close()
