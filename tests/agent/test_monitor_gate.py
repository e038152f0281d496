"""A fused optimizer's update gate: a step whose gradients are NaN/Inf is skipped on the
device, with no host read, between the monitor's reads; a park's decision stands."""

from __future__ import annotations

import os

import pytest
import torch

import breakpod
from tests.agent.nets import Net, batch, train_skipping_nan

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
    from tests.agent.nets import Net, batch, train_skipping_nan
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


# -- a grad_norm rule with action skip, judged on the device
SPIKES = {"name": "spikes", "check": "grad_norm", "action": ["log", "skip"]}


def spiky(optimizer_kind: str, spikes: dict[int, float], rule: dict, *, extra=None):
    """Adam steps at check_every=5 whose loss is scaled by ``spikes[step]`` (the gradients
    with it); per step: (parameters unchanged by its update, reads during its update)."""
    torch.manual_seed(0)
    model = Net()
    if extra is not None:
        model.extra = extra  # watched, never used: its parameters have no gradient
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}[optimizer_kind]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, **kind)
    monitor = breakpod.watch(model, [rule], optimizer=optimizer, check_every=5, replay=False)
    seen = []
    for step in range(20):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y) * spikes.get(step, 1.0)
        optimizer.zero_grad()
        loss.backward()
        before, reads = [p.detach().clone() for p in model.parameters()], monitor.reads
        optimizer.step()
        same = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        seen.append((same, monitor.reads - reads))
    monitor.flush()
    return optimizer, monitor, seen


def test_a_skip_rule_drops_a_gradient_spike_on_the_device_without_a_read_per_step(capfd):
    """Baseline-relative: the spike (1000x, explode_factor 50) comes after the first reads
    made the baselines, and its update is dropped with no read that step or any other
    between reads; the next step, out of range still, is the same outbreak (as the host
    says it once) and applied."""
    optimizer, monitor, seen = spiky("fused", {12: 1000.0, 13: 1000.0}, SPIKES)
    assert [same for same, _ in seen] == [i == 12 for i in range(20)]
    assert sum(reads for _, reads in seen) == 4 and monitor.reads == 4  # every 5 steps
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert found and {a.step for a in found} == {12}
    assert all(a.skipped and "rule 'spikes'" in a.details["skipped"] for a in found)
    assert monitor.skipped_steps == 1
    assert {int(s["step"]) for s in optimizer.state.values()} == {19}
    assert "step 12: update skipped on the device" in capfd.readouterr().err
    monitor.close()


def test_a_max_norm_skip_needs_no_baseline_and_no_read_before_it():
    _, monitor, seen = spiky("fused", {2: 1000.0}, {**SPIKES, "max_norm": 50.0})
    assert [same for same, _ in seen] == [i == 2 for i in range(20)]
    assert seen[2] == (True, 0)  # before the first read, from max_norm alone
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert {a.step for a in found} == {2} and all(a.skipped for a in found)
    monitor.close()


def test_an_inf_update_that_a_skip_rule_also_drops_is_skipped_once_not_applied():
    """A loss scaled by 1e38: the gradient norm overflows to Inf, which trips both
    verdicts, NaN/Inf and the rule's max_norm. The fused
    kernels skip an update only where found_inf is 1.0: the two were added into 2.0,
    and the Inf update went through, while the monitor said it was skipped."""
    optimizer, monitor, seen = spiky("fused", {2: 1e38}, {**SPIKES, "max_norm": 50.0})
    assert seen[2] == (True, 0), seen[:4]  # untouched, and nothing read to decide it
    assert [same for same, _ in seen] == [i == 2 for i in range(20)]
    assert all(bool(torch.isfinite(p).all()) for g in optimizer.param_groups for p in g["params"])
    assert monitor.skipped_steps == 1
    monitor.close()


def test_without_a_fused_optimizer_the_skip_rule_reads_every_step_as_before():
    _, monitor, seen = spiky("foreach", {12: 1000.0}, SPIKES)
    assert seen[12] == (True, 1)  # read before the update, the gradients dropped on the host
    assert monitor.reads == 20
    assert all(a.skipped for a in monitor.anomalies if a.rule == "spikes")
    monitor.close()


def test_a_rule_that_only_logs_lets_the_spike_through():
    _, monitor, seen = spiky("fused", {12: 1000.0}, {**SPIKES, "action": "log"})
    assert not any(same for same, _ in seen)
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert found and not any(a.skipped for a in found)
    monitor.close()


def test_parameters_without_gradients_leave_the_others_judged_on_the_device():
    """A watched module the forward never calls: its group is unseen, on the device as on
    the host, and the spike in the others is still dropped there."""
    _, monitor, seen = spiky("fused", {12: 1000.0}, SPIKES, extra=torch.nn.Linear(3, 3))
    assert seen[12] == (True, 0)
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert found and all(a.skipped for a in found) and "extra" not in {a.module for a in found}
    monitor.close()


def test_a_step_the_loop_skips_does_not_leave_its_verdict_on_the_next_update():
    """With a fused optimizer, a loop's own skip of a NaN step (no optimizer.step()) ends
    that step at the next backward, which set found_inf for an update that never came;
    the next update is judged by its own gradients, not the stale flag."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    monitor = breakpod.watch(model, optimizer=optimizer, check_every=10, replay=False)
    applied = train_skipping_nan(model, optimizer, 5, BAD)
    monitor.flush()
    assert applied == [True, True, False, True, True] and finite(model)
    monitor.close()


def test_a_spike_before_the_device_has_the_baseline_is_said_applied(capfd):
    """The baselines reach the device with the reads: a spike after the warm-up (3 steps)
    but before the first read (step 4) is judged by the host alone, after its update, and
    says so instead of claiming a skip."""
    _, monitor, seen = spiky("fused", {3: 1000.0}, {**SPIKES, "warmup_steps": 3})
    assert not seen[3][0]  # applied
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert found and {a.step for a in found} == {3}
    assert not any(a.skipped for a in found) and monitor.skipped_steps == 0
    assert all("as they stood at the last read" in a.details["applied"] for a in found)
    assert "step 3: rule 'spikes': the update was applied" in capfd.readouterr().err
    monitor.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_skip_rule_needs_no_sync_between_reads():
    """The spike's update is dropped by the fused kernel with no host sync at any step
    between reads: under sync debug "error" a sync inside the monitor counts as an error."""
    torch.manual_seed(0)
    model = Net().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, fused=True)
    monitor = breakpod.watch(model, [SPIKES], optimizer=optimizer, check_every=5, replay=False)
    unchanged = []
    torch.cuda.synchronize()
    for step in range(20):
        x, y = (t.cuda() for t in batch(step))
        before = [p.detach().clone() for p in model.parameters()]
        torch.cuda.set_sync_debug_mode("error" if step % 5 != 4 else 0)  # reads at 4, 9, ...
        try:
            loss = torch.nn.functional.cross_entropy(model(x), y) * (1000.0 if step == 12 else 1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        unchanged.append(
            all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        )
    monitor.flush()
    assert monitor.errors == 0
    assert unchanged == [i == 12 for i in range(20)]
    assert all(a.skipped for a in monitor.anomalies if a.rule == "spikes")
    monitor.close()


def test_under_grad_scaler_a_skip_rule_adds_its_verdict_and_the_scale_holds():
    """GradScaler sets found_inf for a fused optimizer's update; the spike's verdict is
    added to it, so the update is dropped while the scaler, which saw no overflow, keeps
    its scale (a spike is no reason to back off), and takes its flag away as usual."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = breakpod.watch(model, [SPIKES], optimizer=optimizer, check_every=5, replay=False)
    unchanged = []
    for step in range(20):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y) * (1000.0 if step == 12 else 1)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        after = model.parameters()
        unchanged.append(all(torch.equal(b, p) for b, p in zip(before, after, strict=True)))
        assert "found_inf" not in vars(optimizer)
    monitor.flush()
    assert unchanged == [i == 12 for i in range(20)]
    assert scaler.get_scale() == 1024.0
    found = [a for a in monitor.anomalies if a.rule == "spikes"]
    assert found and all(a.skipped for a in found) and monitor.skipped_steps == 1
    monitor.close()
