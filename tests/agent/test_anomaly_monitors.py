"""The remaining monitor items: dead units per unit, the batch at the edge, functional relu,
shape names across steps, snapshots, BatchNorm collapse, no_grad passes, the summary."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import breakpod
from tests.agent.nets import batch, train


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)


class Wide(nn.Module):
    """fc -> ReLU -> head, 64 hidden units."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


class MnistNet(nn.Module):
    """As pytorch/examples mnist: activations are ``F.relu`` calls, not modules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(16, 1, 14, 14, generator=g), torch.randint(0, 10, (16,), generator=g)


def kill_units(layer: nn.Linear, count: int) -> None:
    """These units' pre-activations are negative for every input: dead ReLUs."""
    with torch.no_grad():
        layer.weight[:count].zero_()
        layer.bias[:count].fill_(-1.0)


def dead(monitor: breakpod.Monitor) -> list[tuple[str, int, int]]:
    return [
        (a.module, a.details["dead_units"], a.details["units"])
        for a in monitor.anomalies
        if a.check == "dead_units"
    ]


def test_a_layer_with_61_of_64_dead_units_fires_under_the_default_rules():
    torch.manual_seed(0)
    model = Wide()
    kill_units(model.fc, 61)
    monitor = breakpod.watch(model, tier="detailed")  # the sentinel's defaults hook no ReLU
    train(model, monitor, 6)
    monitor.flush()
    assert dead(monitor) == [("act", 61, 64)], monitor.anomalies
    (a,) = [a for a in monitor.anomalies if a.check == "dead_units"]
    assert a.step == 2 and "61 of 64 units" in a.summary, a.summary
    monitor.close()


def test_a_healthy_relu_layer_has_no_dead_units_anomaly():
    torch.manual_seed(0)
    model = Wide()
    monitor = breakpod.watch(model)
    train(model, monitor, 100)
    monitor.flush()
    assert monitor.anomalies == [] and monitor.errors == 0


def test_a_non_finite_batch_is_blamed_on_the_batch_not_the_first_module():
    torch.manual_seed(0)
    model = MnistNet()
    monitor = breakpod.watch(model)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = images(step)
        if step == 3:
            x[2, 0, 4, 4] = float("nan")  # one corrupt sample
        return x, y

    train(model, monitor, 4, inputs=inputs, loss_fn=F.nll_loss)
    monitor.flush()
    (a,) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert (a.step, a.module, a.phase) == (3, "conv1", "input"), a
    assert "input of conv1 (the batch) has non-finite values" in a.summary, a.summary
    monitor.close()


def test_a_nan_made_by_the_first_module_is_still_that_module():
    model = MnistNet()
    monitor = breakpod.watch(model)

    def before(step: int) -> None:
        if step == 2:
            with torch.no_grad():
                model.conv1.bias[0] = float("inf") - float("inf")

    train(model, monitor, 3, before=before, inputs=images, loss_fn=F.nll_loss)
    monitor.flush()
    a = next(a for a in monitor.anomalies if a.check == "nonfinite")
    assert (a.step, a.module, a.phase) == (2, "conv1", "forward"), a


def test_functional_relu_dead_units_are_seen_with_the_one_line_opt_in():
    """No ReLU module to hook: the default rule cannot see them; ``pre_relu`` on the
    modules that feed ``F.relu`` counts units that are <= 0 over the whole batch."""
    opt_in = [
        {"check": "dead_units", "modules": ["conv1", "conv2", "fc1"], "pre_relu": True,
         "consecutive": 3}
    ]  # fmt: skip
    found = {}
    for rules in (None, opt_in):
        torch.manual_seed(0)
        model = MnistNet()
        kill_units(model.fc1, 61)
        monitor = breakpod.watch(model, rules)
        train(model, monitor, 6, inputs=images, loss_fn=F.nll_loss)
        monitor.flush()
        found[rules is None] = dead(monitor)
        assert monitor.errors == 0
        monitor.close()
    assert found[True] == []  # without the opt-in: invisible, as documented
    ((module, count, units),) = found[False]  # the 61 killed, and any unit dead by chance
    assert (module, units) == ("fc1", 64) and 61 <= count <= 63, found


def test_functional_relu_opt_in_is_quiet_on_a_healthy_run():
    torch.manual_seed(0)
    model = MnistNet()
    rules = [{"check": "dead_units", "modules": ["conv1", "conv2", "fc1"], "pre_relu": True}]
    monitor = breakpod.watch(model, rules)
    train(model, monitor, 60, inputs=images, loss_fn=F.nll_loss, lr=0.01)
    monitor.flush()
    assert dead(monitor) == [] and monitor.errors == 0


def test_shape_names_carry_across_steps_but_the_batch_may_shrink():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    monitor = breakpod.watch(model, expect={"0.layers.*": "B,T,D"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # steps 0-5: B may shrink (step 2); T changes (step 3); a (T, B, D) transpose (step 5)
    for shape in [(8, 10), (8, 10), (5, 10), (8, 12), (8, 10), "transposed"]:
        x = torch.randn(*(shape if shape != "transposed" else (8, 10)), 32)
        if shape == "transposed":
            x = x.transpose(0, 1)  # (T, B, D) fed to a batch_first model
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)
    monitor.flush()
    shape_steps = {(a.step, a.module) for a in monitor.anomalies if a.check == "shape"}
    assert shape_steps == {(s, f"0.layers.{i}") for s in (3, 5) for i in (0, 1)}
    t_change = next(a for a in monitor.anomalies if a.step == 3)
    assert "dim 1 is 12, but T=10 in earlier steps" in t_change.summary, t_change.summary
    monitor.close()


def test_snapshots_keep_the_gradient_and_one_file_per_parameter(tmp_path):
    torch.manual_seed(0)
    model = Wide()
    rule = {"name": "big", "check": "grad_norm", "group": "param", "max_norm": 1e-9,
            "modules": "fc", "action": "snapshot"}  # fmt: skip
    monitor = breakpod.watch(model, [rule], snapshot_dir=tmp_path)
    train(model, monitor, 1)
    monitor.flush()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["step0000000-big-fc-bias.pt", "step0000000-big-fc-weight.pt"], files
    for name in ("weight", "bias"):
        saved = torch.load(tmp_path / f"step0000000-big-fc-{name}.pt", weights_only=False)
        assert list(saved["grads"]) == [name]
        assert torch.equal(saved["grads"][name], getattr(model.fc, name).grad)
        assert saved["anomaly"]["details"]["group"] == f"fc.{name}"
    monitor.close()


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.5)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.bn(self.conv(x)).mean((2, 3))), dim=1)


def test_batchnorm_running_variance_collapse_is_in_the_default_range():
    """A frozen conv with a dead filter: its channel is constant, its running var goes to 0."""
    torch.manual_seed(0)
    model = ConvBN()
    with torch.no_grad():
        model.conv.weight[0].zero_()
        model.conv.bias[0] = 0.3
    model.conv.requires_grad_(False)
    monitor = breakpod.watch(model)
    train(model, monitor, 30, inputs=images, loss_fn=F.nll_loss)
    monitor.flush()
    (a,) = [a for a in monitor.anomalies if a.check == "batchnorm"]
    assert a.module == "bn" and 15 <= a.step <= 29, a
    assert float(a.summary.split("var in [")[1].split(",")[0]) < 1e-6, a.summary
    monitor.close()


def test_a_no_grad_evaluation_pass_does_not_count_in_the_next_training_step():
    torch.manual_seed(0)
    model = Wide()
    monitor = breakpod.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)
        with torch.no_grad():  # evaluation on a corrupt held-out batch
            model(torch.full((4, 8), float("nan")) if step == 2 else batch(100 + step)[0])
    monitor.flush()
    assert monitor.anomalies == [] and monitor.errors == 0


@pytest.mark.parametrize("step_inside", [False, True], ids=["pass-inside", "step-inside"])
def test_an_inference_mode_pass_before_training_leaves_the_monitor_working(step_inside):
    """Buffers first made under ``torch.inference_mode()`` (the stats buffers in the pass,
    the gradient-norm baselines in ``step()``) would be inference tensors, which training
    could never write again: the monitor failed on every later step."""
    model = Wide()
    monitor = breakpod.watch(model)
    with torch.inference_mode():
        model(batch(0)[0])
        if step_inside:
            monitor.step()
    if not step_inside:
        monitor.step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 4):
        x, y = batch(step)
        if step == 3:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        monitor.step(loss)
        optimizer.step()
    monitor.flush()
    assert monitor.errors == 0
    a = next(a for a in monitor.anomalies if a.check == "nonfinite")
    assert a.step == 3 and a.phase == "input", a


def test_an_inference_only_job_is_still_checked():
    model = Wide()
    monitor = breakpod.watch(model)
    with torch.no_grad():
        for step in range(4):
            x = batch(step)[0]
            if step == 2:
                with torch.no_grad():
                    model.fc.bias[0] = float("nan")
            model(x)
            monitor.step()
    monitor.flush()
    a = next(a for a in monitor.anomalies if a.check == "nonfinite")
    assert (a.step, a.module) == (2, "fc"), a


def test_summary_keeps_every_count_with_many_rules():
    rules = [
        {"name": f"shape-rule-number-{i}", "check": "shape", "expect": "*,*"} for i in range(9)
    ]
    monitor = breakpod.watch(Wide(), rules, tier="detailed")  # 5 defaults + 9
    line = breakpod.summary(monitor)
    assert line.startswith("monitor on: step 0, 0 anomalies, 0 skipped steps, 0 errors; 14 rules:")
    assert len(line) <= 120 and line.endswith(" more"), line
    shown = line.split("14 rules: ")[1].rpartition(" +")[0].split(", ")
    assert line.endswith(f"+{14 - len(shown)} more"), line
    monitor.close()
