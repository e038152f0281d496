"""The sentinel tier: no module hooks, a NaN localized by replaying its step, the detailed
tier turned on when a replay cannot localize, and the tier settings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import breakpod
from breakpod._core.errors import ConfigError
from breakpod._monitor import checks
from tests.agent import nets
from tests.agent.nets import Net, batch, train

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    for var in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_MONITOR_TIER", "BREAKPOD_REPLAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("BREAKPOD_DETAILED_STEPS", raising=False)


def poisoned(mode: str, at: int) -> tuple[Net, object]:
    torch.manual_seed(0)
    model = Net()

    def before(step: int) -> None:
        model.poison.mode = mode if step == at else None

    return model, before


def hooked(model: nn.Module) -> list[str]:
    """Modules below the root with a forward hook of any kind."""
    return [
        name
        for name, m in model.named_modules()
        if name and (m._forward_hooks or m._forward_pre_hooks)
    ]


def nonfinite(monitor: breakpod.Monitor) -> list[breakpod.Anomaly]:
    return [a for a in monitor.anomalies if a.check == "nonfinite"]


def test_the_default_tier_is_the_sentinel_and_hooks_no_module():
    torch.manual_seed(0)
    model = Net()
    monitor = breakpod.watch(model)
    assert monitor.tier == "sentinel"
    assert hooked(model) == []
    train(model, monitor, 4)
    monitor.flush()
    assert monitor.anomalies == [] and monitor.errors == 0
    monitor.close()


@pytest.mark.parametrize(
    ("mode", "phase", "op"), [("forward", "forward", "aten.log"), ("backward", "backward", "")]
)
def test_a_nan_is_localized_by_replay_at_the_module_that_made_it(mode, phase, op):
    model, before = poisoned(mode, at=3)
    monitor = breakpod.watch(model)
    train(model, monitor, 5, before=before)
    monitor.flush()
    (a,) = nonfinite(monitor)
    assert (a.step, a.phase, a.module) == (3, phase, "poison"), a
    assert (a.tier, a.how) == ("sentinel", "replay"), a
    assert op in a.details["op"] and "'poison'" in a.details["op"], a.details
    assert "reproduced bit-exactly" in a.details["localized"], a.details
    assert a.to_dict()["how"] == "replay"  # the event carries it
    monitor.close()


def test_the_detailed_tier_names_the_same_module_live():
    model, before = poisoned("backward", at=3)
    monitor = breakpod.watch(model, tier="detailed")
    train(model, monitor, 5, before=before)
    monitor.flush()
    (a,) = nonfinite(monitor)
    assert (a.step, a.phase, a.module, a.tier, a.how) == (
        3,
        "backward",
        "poison",
        "detailed",
        "live",
    )
    monitor.close()


def test_with_the_optimizer_hook_the_replay_runs_before_the_update():
    model, before = poisoned("forward", at=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []

    def sink(anomaly: breakpod.Anomaly) -> None:  # runs at the step's end, before the update
        seen.append(all(bool(p.isfinite().all()) for p in model.parameters()))

    monitor = breakpod.watch(model, optimizer=optimizer, sink=sink)
    for step in range(3):
        before(step)
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        monitor.record_loss(loss)
        optimizer.step()
    (a,) = nonfinite(monitor)
    assert (a.step, a.module, a.how) == (2, "poison", "replay"), a
    assert seen == [True], "the weights were already updated with NaN when it was reported"
    assert monitor.reads == 3  # one host read per step at check_every=1
    monitor.close()


class Flaky(nn.Module):
    """Its backward makes a NaN on chosen calls only: a replay (one more call) does not."""

    def __init__(self, bad_calls: set[int]) -> None:
        super().__init__()
        self.calls = 0
        self.bad_calls = bad_calls
        flaky = self

        class Grad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):  # type: ignore[no-untyped-def]
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):  # type: ignore[no-untyped-def]
                flaky.calls += 1
                return grad * float("nan") if flaky.calls in flaky.bad_calls else grad

        self.grad = Grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grad.apply(x)


def train_skipping_bad_updates(model: nn.Module, monitor: breakpod.Monitor, steps: int) -> None:
    """As GradScaler does: a step whose gradients are not finite applies no update."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        monitor.step(loss)
        if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            optimizer.step()


def test_a_replay_that_does_not_reproduce_says_so_and_turns_the_detailed_tier_on(capfd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Flaky({3, 7}), nn.Linear(16, 4))
    monitor = breakpod.watch(model)
    train_skipping_bad_updates(model, monitor, 8)
    monitor.flush()
    first, second = nonfinite(monitor)
    # step 2 (backward call 3): its replay (call 4) is healthy, so the sentinel's finding stays
    assert (first.step, first.tier, first.how) == (2, "sentinel", "live"), first
    assert "did not reproduce" in first.details["localized"], first.details
    # calls 5 and 6 are steps 3 and 4, call 7 is step 5: the detailed tier saw it live
    assert (second.step, second.module, second.phase) == (5, "1", "backward"), second
    assert (second.tier, second.how) == ("detailed", "live"), second
    assert "the detailed tier is on for the next 100 steps" in capfd.readouterr().err
    monitor.close()


def test_a_nan_from_an_earlier_forward_of_the_step_says_so_and_turns_the_detailed_tier_on(
    capfd,
):
    """Two forwards before one backward (a siamese or contrastive loss): the capture holds
    the last, whose replay is finite. The NaN came from the first: said so, and the next
    one is localized live. (Before, the finding went out with no module, no escalation.)"""
    torch.manual_seed(0)
    model = Net()
    monitor = breakpod.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        (x1, y1), (x2, y2) = batch(2 * step), batch(2 * step + 1)
        model.poison.mode = "forward" if step in (2, 4) else None
        first = nn.functional.cross_entropy(model(x1), y1)
        model.poison.mode = None
        loss = first + nn.functional.cross_entropy(model(x2), y2)
        optimizer.zero_grad()
        loss.backward()
        monitor.step(loss)
        if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            optimizer.step()
    monitor.flush()
    early, later = nonfinite(monitor)[:2]
    assert early.step == 2 and early.how == "live", early
    assert (
        "the step ran 2 forwards (only the last is captured): the NaN/Inf came from an "
        "earlier one" in early.details["localized"]
    ), early.details
    assert "another rank" not in early.details["localized"]
    assert (later.step, later.module, later.phase, later.how) == (4, "poison", "forward", "live")
    assert "the detailed tier is on for the next 100 steps" in capfd.readouterr().err
    monitor.close()


def test_the_detailed_tier_turned_on_mid_outbreak_does_not_report_it_again():
    """A NaN weight from step 2 on: one outbreak. Its step's replay cannot be compared
    (the loop never zeroes the gradients, so they accumulate), so the detailed tier
    turns on, and its first look, at step 3, finds the weight NaN: that is the same
    outbreak, said once (it used to be said again at step 3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():  # hidden unit 0 is never active: the NaN below leaves grads finite
        model[0].weight[0].zero_()
        model[0].bias[0] = -1.0
    rules = [{"check": "nonfinite", "where": ["param"]}]
    monitor = breakpod.watch(model, rules, config={"defaults": False})
    for step in range(5):
        if step == 2:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        model(torch.randn(3, 4)).sum().backward()
        monitor.step()
    monitor.flush()
    assert [(a.step, a.module) for a in monitor.anomalies] == [(2, "2")]
    assert "did not reproduce" in monitor.anomalies[0].details["localized"]
    assert monitor.errors == 0
    monitor.close()


def test_the_detailed_tier_goes_off_again_after_its_steps(monkeypatch, capfd):
    monkeypatch.setenv("BREAKPOD_DETAILED_STEPS", "2")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Flaky({3}), nn.Linear(16, 4))
    monitor = breakpod.watch(model)
    train_skipping_bad_updates(model, monitor, 3)
    assert hooked(model) != []  # the detailed tier's hooks, for two steps
    train_skipping_bad_updates(model, monitor, 3)
    assert hooked(model) == []
    assert "the detailed tier is off again" in capfd.readouterr().err
    assert monitor.errors == 0
    monitor.close()


def test_on_a_cpu_a_nan_between_reads_is_localized_at_its_own_step():
    """The end of its backward sees it (no device sync on a CPU): read at its step's end,
    with its capture still there, one read more than check_every alone."""
    model, before = poisoned("forward", at=1)
    monitor = breakpod.watch(model, check_every=4)
    train(model, monitor, 4, before=before)
    monitor.flush()
    (a,) = nonfinite(monitor)
    assert (a.step, a.module, a.phase, a.how) == (1, "poison", "forward", "replay"), a
    assert monitor.reads == 2
    monitor.close()


def test_a_step_whose_capture_is_gone_is_not_localized_and_turns_the_detailed_tier_on():
    torch.manual_seed(0)
    model = Net()
    monitor = breakpod.watch(model)
    train(model, monitor, 3)
    found, why = monitor._localization(0)  # as a GPU read that lands after the next forward
    assert found == {} and "step 0 is no longer captured" in why, why
    assert hooked(model) != []  # the detailed tier, for the next occurrence
    monitor.close()
    assert hooked(model) == []


def test_no_read_between_reads_at_check_every_above_one():
    torch.manual_seed(0)
    model = Net()
    monitor = breakpod.watch(model, check_every=5)
    train(model, monitor, 10)
    assert monitor.reads == 2
    monitor.close()


def test_a_rule_that_reads_outputs_hooks_only_the_modules_it_names():
    torch.manual_seed(0)
    model = Net()
    rules = [{"name": "dead", "check": "dead_units", "modules": "act2"}]
    monitor = breakpod.watch(model, rules, expect={"fc3": "B,4"})
    assert sorted(hooked(model)) == ["act2", "fc3"]
    monitor.close()


def test_the_sentinel_defaults_leave_out_dead_units_and_the_detailed_keep_them():
    names = {r.name for r in breakpod.watch(Net()).rules}
    assert "dead_units" not in names and {"nonfinite", "grad_norm", "loss_spike"} <= names
    assert "dead_units" in {r.name for r in breakpod.watch(Net(), tier="detailed").rules}


def test_the_tier_comes_from_the_argument_the_config_or_the_environment(monkeypatch):
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "detailed")
    assert breakpod.watch(Net()).tier == "detailed"
    assert breakpod.watch(Net(), tier="sentinel").tier == "sentinel"
    monkeypatch.delenv("BREAKPOD_MONITOR_TIER")
    assert breakpod.watch(Net(), config={"tier": "detailed"}).tier == "detailed"
    with pytest.raises(ConfigError, match="expected one of sentinel, detailed"):
        breakpod.watch(Net(), tier="fast")
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "everything")
    with pytest.raises(ConfigError, match="BREAKPOD_MONITOR_TIER='everything'"):
        breakpod.watch(Net())


def test_with_replay_off_the_sentinel_says_it_did_not_localize():
    model, before = poisoned("forward", at=2)
    monitor = breakpod.watch(model, replay=False)
    train(model, monitor, 3, before=before)
    monitor.flush()
    (a,) = nonfinite(monitor)
    assert a.how == "live" and "replay capture is off" in a.details["localized"], a
    monitor.close()


def syncs_per_step(monitor: breakpod.Monitor, model: nn.Module, steps: int) -> list[int]:
    """Host syncs in each step, as CUDA's sync debug mode warns of them."""
    import warnings

    optimizer = monitor._optimizer
    x, y = (t.cuda() for t in batch(0))
    counts = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                monitor.record_loss(loss)
                optimizer.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    return counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("every", [1, 4])
def test_on_cuda_the_sentinel_reads_at_most_once_a_step_and_never_between_reads(every):
    torch.manual_seed(0)
    model = Net().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, optimizer=optimizer, check_every=every)
    syncs_per_step(monitor, model, 3)  # warm-up: lazy allocations
    counts = syncs_per_step(monitor, model, 8)
    assert max(counts) <= 1, counts
    if every > 1:  # steps 3..10: reads at the ends of steps 3 and 7 only
        assert [c for i, c in enumerate(counts, 3) if (i + 1) % every] == [0] * 6, counts
    assert monitor.errors == 0
    monitor.close()


def test_a_forward_nan_its_replay_does_not_make_is_not_blamed_on_the_backward():
    """A fault on the module's Nth call: the replay's forward (one call more) is finite and
    only the captured output gradient brings the NaN back, so the first backward site is
    no finding: the step did not reproduce, and the detailed tier takes over."""
    torch.manual_seed(0)
    model = Net()
    calls = [0]

    def poison(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor | None:
        calls[0] += 1
        return output * float("nan") if calls[0] == 3 else None

    model.fc2.register_forward_hook(poison)
    monitor = breakpod.watch(model)
    train_skipping_bad_updates(model, monitor, 4)
    monitor.flush()
    (a,) = nonfinite(monitor)
    assert (a.step, a.how) == (2, "live") and a.module != "fc3", a
    assert "outputs were non-finite in the step and finite in its replay" in a.details["localized"]
    assert len(hooked(model)) > 1  # the detailed tier's hooks, besides the poison's own
    monitor.close()


def test_a_localizing_replay_counts_the_models_ops_only_not_its_probes():
    """The probe's statistics (detaches, staging blocks of uninitialized memory) are the
    monitor's own ops: the localizing replay sees as many ops as a plain replay, and its
    first bad op is the model's, never one of the probe's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    monitor = breakpod.watch(net, optimizer=opt, sink=lambda a: None)
    plain = None
    for step in range(4):
        x = torch.randn(16, 4)
        if step == 3:
            x[0, 0] = float("nan")
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step == 3:
            plain = monitor.replay().ops
        opt.step()
    monitor.close()
    found = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert found and found[0].how == "replay", found
    assert f"({plain} ops)" in found[0].details["localized"], (plain, found[0].details)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.poison = nets.Poison()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.bn(self.poison(self.fc1(x))))


def batchnorm_reads(monkeypatch, rules: list[dict] | None, steps: int) -> list[int]:
    """The steps at whose reads the monitor took BatchNorm's running statistics."""
    torch.manual_seed(0)
    model = BNNet()
    monitor = breakpod.watch(model, rules)
    taken: list[int] = []
    real = checks.batchnorm_stats

    def spy(modules):  # type: ignore[no-untyped-def]
        taken.append(monitor.step_count - 1)  # the step just ended
        return real(modules)

    monkeypatch.setattr(checks, "batchnorm_stats", spy)
    train(model, monitor, steps)
    monitor.close()
    return taken


def test_the_sentinels_batchnorm_rule_reads_the_statistics_once_in_ten_steps(monkeypatch):
    """Its ranges are crossed by a drift over many steps: a read of 7 foreach ops on every
    step bought nothing. A rule of the user's own reads them at every read."""
    assert batchnorm_reads(monkeypatch, None, 25) == [0, 10, 20]
    mine = [{"check": "batchnorm", "var_range": [1e-8, 1e8]}]
    assert batchnorm_reads(monkeypatch, mine, 5) == [0, 1, 2, 3, 4]


def test_a_nan_step_reads_the_batchnorm_statistics_at_once():
    """The NaN the forward wrote into the running mean is said with its own step, not
    up to ten steps later."""
    torch.manual_seed(0)
    model = BNNet()
    monitor = breakpod.watch(model)

    def before(step: int) -> None:
        model.poison.mode = "forward" if step == 4 else None

    train(model, monitor, 6, before=before)
    monitor.flush()
    said = [(a.step, a.check, a.module) for a in monitor.anomalies]
    assert (4, "batchnorm", "bn") in said, said
    monitor.close()
