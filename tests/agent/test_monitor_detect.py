"""Each check catches its fault on a real model, at the right step and module."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

import breakpod
from breakpod._monitor.detect import Detector, ParamInfo, StepData
from tests.agent.nets import Net, batch, train


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def poison_at(model: Net, step: int, mode: str):
    def before(s: int) -> None:
        model.poison.mode = mode if s == step else None

    return before


@pytest.mark.parametrize("check_every", [1, 3])
def test_forward_nan_names_the_first_module_and_step(check_every):
    model = Net()
    monitor = breakpod.watch(model, check_every=check_every)
    train(model, monitor, 7, before=poison_at(model, 4, "forward"))
    monitor.flush()
    bad = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert len(bad) == 1, bad  # reported once, not at every later step
    (a,) = bad
    assert (a.rule, a.step, a.module, a.phase) == ("nonfinite", 4, "poison", "forward")
    assert "-inf" in a.summary and "output of poison" in a.summary
    assert monitor.errors == 0


def test_backward_nan_names_the_module_whose_backward_made_it():
    model = Net()
    monitor = breakpod.watch(model)
    train(model, monitor, 6, before=poison_at(model, 3, "backward"))
    bad = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert bad, monitor.anomalies
    a = bad[0]
    assert (a.step, a.module, a.phase) == (3, "poison", "backward"), a
    assert "gradient w.r.t. the input of poison" in a.summary


def test_loss_nan_without_any_module_fault_is_reported_as_loss():
    model = Net()
    monitor = breakpod.watch(model)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y) * torch.log(torch.zeros(()))

    train(model, monitor, 1, loss_fn=loss_fn)
    a = monitor.anomalies[0]
    assert (a.step, a.phase, a.module) == (0, "loss", "")


def test_shape_contract_violation_names_module_expected_and_actual():
    model = Net()
    monitor = breakpod.watch(model, expect={"fc2": "B,32", "fc3": (None, 4)})
    train(model, monitor, 3)
    shape = [a for a in monitor.anomalies if a.check == "shape"]
    assert len(shape) == 1, monitor.anomalies  # once, not every step
    a = shape[0]
    assert (a.rule, a.module, a.step) == ("shape:fc2", "fc2", 0)
    assert "(B, 32)" in a.summary and "[32, 16]" in a.summary and "dim 1 is 16" in a.summary


def test_shape_rule_from_a_rules_list_with_symbols():
    model = Net()
    rules = [{"name": "hidden", "check": "shape", "modules": ["fc1", "fc2"], "expect": "N,16"}]
    monitor = breakpod.watch(model, rules)
    train(model, monitor, 2)
    assert [a for a in monitor.anomalies if a.check == "shape"] == []


def test_exploding_gradient_from_a_large_learning_rate():
    model = Net(d_out=1)
    monitor = breakpod.watch(model)
    optimizer = train(model, monitor, 6, loss_fn=_mse, lr=0.01)
    for group in optimizer.param_groups:
        group["lr"] = 5.0
    for step in range(6, 14):
        x, y = batch(step)
        loss = _mse(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)
    exploding = [a for a in monitor.anomalies if a.details.get("kind") == "exploding"]
    assert exploding, monitor.anomalies
    a = exploding[0]
    assert a.rule == "grad_norm" and a.phase == "backward" and a.step >= 6
    assert "x its baseline" in a.summary and math.isfinite(a.value)
    first_nan = [b.step for b in monitor.anomalies if b.check == "nonfinite"]
    assert not first_nan or a.step < first_nan[0]  # caught before it turned into NaN


def test_vanishing_gradient_when_tanh_saturates():
    model = Net(act=nn.Tanh)
    monitor = breakpod.watch(model)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        return (x * 1e4 if step >= 8 else x), y

    train(model, monitor, 10, inputs=inputs)
    vanishing = [a for a in monitor.anomalies if a.details.get("kind") == "vanishing"]
    assert vanishing, monitor.anomalies
    assert {a.step for a in vanishing} == {8}
    assert "fc1" in {a.module for a in vanishing}
    assert all(a.rule == "grad_norm" for a in vanishing)


def test_the_gradient_baseline_follows_a_slow_decay_but_not_a_sudden_drop():
    """Norms shrink 2% a step (0.2% of the start after 300 steps): healthy, no alarm;
    then a 1000x drop in one step is still reported. The steps are a real first step's
    statistics, scaled (as a loss scaled without an update would scale them)."""
    model = Net()
    detector, step0 = synthetic(model)
    found = []
    for step in range(310):
        scale = 0.98**step * (1e-3 if step >= 300 else 1.0)
        found += detector.run(step0.scaled(step, scale))
    vanishing = [a for a, _ in found if a.details.get("kind") == "vanishing"]
    assert {(a.step, a.module) for a in vanishing} == {(300, "fc1"), (300, "fc2"), (300, "fc3")}
    assert len(found) == len(vanishing)


def test_dead_relu_three_steps_in_a_row():
    model = Net()
    monitor = breakpod.watch(model, tier="detailed")  # dead units: hooks

    def before(step: int) -> None:
        if step == 10:
            with torch.no_grad():
                model.fc2.bias.fill_(-1e3)  # every pre-activation negative: act2 outputs zeros

    train(model, monitor, 14, before=before, lr=0.0)
    dead = [a for a in monitor.anomalies if a.check == "dead_units"]
    assert len(dead) == 1, monitor.anomalies
    a = dead[0]
    assert (a.rule, a.module, a.step, a.phase) == ("dead_units", "act2", 12, "forward")
    assert a.value == 1.0 and "3 steps in a row" in a.summary


def test_custom_dead_units_rule_on_a_linear_output():
    model = Net()
    rules = [{"name": "fc3-dead", "check": "dead_units", "modules": "fc3", "consecutive": 2}]
    monitor = breakpod.watch(model, rules)
    with torch.no_grad():
        model.fc3.weight.zero_()
        model.fc3.bias.zero_()
    train(model, monitor, 3, lr=0.0)
    assert [(a.rule, a.step) for a in monitor.anomalies if a.check == "dead_units"] == [
        ("fc3-dead", 1)
    ]


def test_activation_magnitude_and_loss_spike():
    model = Net(d_out=1)
    rules = [{"name": "big", "check": "activation", "modules": "fc2", "max_mean_abs": 50}]
    monitor = breakpod.watch(model, rules)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        return (x * 1000 if step == 15 else x), y

    train(model, monitor, 16, inputs=inputs, loss_fn=_mse, lr=0.001)
    found = {(a.rule, a.step, a.module) for a in monitor.anomalies}
    assert ("big", 15, "fc2") in found
    assert ("loss_spike", 15, "") in found


def test_batchnorm_running_stats_out_of_range():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    rules = [{"name": "bn", "check": "batchnorm", "mean_range": [-5, 5]}]
    monitor = breakpod.watch(model, rules)

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        return (x * 1e3 if step >= 4 else x), y

    train(model, monitor, 6, inputs=inputs, lr=0.0)
    bn = [a for a in monitor.anomalies if a.rule == "bn"]
    assert len(bn) == 1 and bn[0].module == "1" and bn[0].phase == "param" and bn[0].step == 4


def test_nonfinite_parameter_is_reported_in_phase_param():
    model = Net()
    rules = [{"name": "params", "check": "nonfinite", "where": ["param"]}]
    monitor = breakpod.watch(model, rules)
    train(model, monitor, 2)
    with torch.no_grad():
        model.fc3.bias[0] = float("inf")
    monitor.step()  # parameters are state: checked at each read, no forward needed
    params = [a for a in monitor.anomalies if a.rule == "params"]
    assert params and params[0].phase == "param" and params[0].module == "fc3"
    assert params[0].details["param"] == "fc3.bias"


def healthy_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


def test_healthy_run_reports_nothing():
    """A short real run past the warm-ups (gradient baseline, loss window): no anomaly."""
    model = healthy_model()
    monitor = breakpod.watch(model, expect={"0": "B,16", "5": (None, 4)}, tier="detailed")
    train(model, monitor, 20)
    monitor.flush()
    assert monitor.anomalies == []
    assert monitor.errors == 0 and monitor.step_count == 20 and monitor.reads == 20
    assert set(monitor.shapes) == {name for name, _ in model.named_modules()}  # for tshape
    assert monitor.shapes["1"] == ([(32, 16)], (32, 16))


def test_200_healthy_steps_of_noisy_statistics_raise_nothing_and_a_jump_still_does():
    """The checks that carry state across steps (gradient baselines, the loss window,
    batchnorm ranges) over 200 steps of a real first step's statistics with the
    step-to-step noise of training (each norm and the loss within about 3x, drifting
    down), then one layer's gradients 1000x their usual size."""
    model = healthy_model()
    detector, step0 = synthetic(model)
    noise = random.Random(7)
    found = []
    for step in range(200):
        drift = 0.995**step
        data = step0.scaled(step, drift, jitter=lambda: math.exp(noise.gauss(0, 0.4)))
        found += detector.run(data)
    assert found == []
    jump = step0.scaled(200, 0.995**200)
    for i in (0, 1):  # the first layer's weight and bias
        jump.grads[i] *= 1000
    assert [(a.rule, a.module, a.details["kind"]) for a, _ in detector.run(jump)] == [
        ("grad_norm", "0", "exploding")
    ]


def test_check_every_reads_the_host_once_per_n_steps():
    model = Net()
    monitor = breakpod.watch(model, check_every=5)
    train(model, monitor, 12)
    assert monitor.reads == 2
    monitor.flush()
    assert monitor.reads == 3


def test_optimizer_hook_ends_steps_and_record_loss_feeds_the_loss_checks():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, optimizer=optimizer)
    for step in range(3):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y) * (math.nan if step == 2 else 1)
        monitor.record_loss(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert monitor.step_count == 3
    assert any(a.step == 2 and a.check == "nonfinite" for a in monitor.anomalies)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y.float())


def test_corrupt_parameter_of_a_skipped_layer_is_named_in_the_report():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    monitor = breakpod.watch(model)
    with torch.no_grad():
        model[1].weight[0] = math.nan  # BatchNorm is a pass-through layer: not checked itself
    monitor.step(model(batch(0)[0]).sum())  # no update, so only that parameter is bad
    (a,) = [a for a in monitor.anomalies if a.check == "nonfinite"]
    assert (a.step, a.module, a.phase) == (0, "3", "forward")
    assert a.details["nonfinite_params"] == ["1.weight"]


# -- synthetic steps: the statistics a real step produces, fed to the detector -------------


@dataclasses.dataclass
class FirstStep:
    """One real step's host-side statistics: each parameter's gradient norm, the loss and
    each BatchNorm's running-stat ranges (what the monitor reads off the device)."""

    grads: dict[int, float]
    loss: float
    batchnorm: dict[str, list[float]]

    def scaled(
        self, step: int, scale: float, jitter: Callable[[], float] = lambda: 1.0
    ) -> StepData:
        grads = {i: norm * scale * jitter() for i, norm in self.grads.items()}
        return StepData(
            step, grads=grads, loss=self.loss * scale * jitter(), batchnorm=self.batchnorm
        )


def synthetic(model: nn.Module) -> tuple[Detector, FirstStep]:
    """The rules ``watch()`` runs on ``model``, in a detector of their own, and one real
    forward and backward's statistics (no update)."""
    monitor = breakpod.watch(model)
    rules = monitor.rules
    monitor.close()
    x, y = batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    names = [name for name, _ in model.named_parameters()]
    watching = frozenset(r.name for r in rules if r.check == "grad_norm")
    params = [ParamInfo(name, name.rpartition(".")[0], watching) for name in names]
    norms = {i: float(p.grad.norm()) for i, (_, p) in enumerate(model.named_parameters())}
    bn_rules = frozenset(r.name for r in rules if r.check == "batchnorm")
    bns = {n: m for n, m in model.named_modules() if getattr(m, "running_var", None) is not None}
    ranges = {n: _ranges(m) for n, m in bns.items()}
    detector = Detector(rules, params, {n: bn_rules for n in bns})
    return detector, FirstStep(norms, float(loss.detach()), ranges)


def _ranges(bn: nn.Module) -> list[float]:
    mean, var = bn.running_mean, bn.running_var
    return [float(mean.min()), float(mean.max()), float(var.min()), float(var.max())]


class Cached(nn.Module):
    """Returns the same buffer object every step; it turns NaN at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("value", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cache = Cached()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) + self.cache(x))


def test_a_tensor_a_module_returns_every_step_is_checked_every_step():
    """The mark that keeps a container from checking its submodule's output again held
    across steps: the buffer was checked once, and its NaN blamed on the consumer."""
    model = WithCache()

    def forward(step: int) -> torch.Tensor:
        if step == 2:
            model.cache.value.fill_(math.nan)
        return model(torch.randn(3, 4))

    assert first_nonfinite(model, forward, steps=4) == (2, "cache", "forward")


class BadGrad(torch.autograd.Function):
    on = False

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * (math.nan if BadGrad.on else 1.0)


def first_nonfinite(
    model: nn.Module, forward: Callable[[int], torch.Tensor], steps: int = 3
) -> tuple[int, str, str]:
    """Train with the nonfinite rule alone, ``forward(step)`` making each step's output:
    the first anomaly's step, module and phase (and no error inside the monitor)."""
    monitor = breakpod.watch(model, [{"check": "nonfinite"}], config={"defaults": False})
    for step in range(steps):
        try:
            forward(step).sum().backward()
        finally:
            BadGrad.on = False
        monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert found and monitor.errors == 0, (found, monitor.errors)
    return found[0].step, found[0].module, found[0].phase


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.fc(BadGrad.apply(q))  # its backward makes a NaN when BadGrad.on


class Queries(nn.Module):
    """A learned parameter fed to a module as its input (DETR's object queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(3, 4))
        self.dec = Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.q) * x


def test_watching_again_hooks_the_gradients_the_first_monitor_hooked():
    """A leaf input keeps its tensor hook and its mark: the first monitor's mark kept a
    second monitor off it, and the closed monitor's hook still ran."""
    model, x = Queries(), torch.randn(3, 4)
    rules = [{"check": "nonfinite", "where": ["gradient"]}]
    first = breakpod.watch(model, rules, config={"defaults": False})
    model(x).sum().backward()
    first.step()
    second = breakpod.watch(model, rules, config={"defaults": False})  # closes the first
    BadGrad.on = True
    try:
        model.zero_grad()
        model(x).sum().backward()
        second.step()
    finally:
        BadGrad.on = False
    found = second.flush() or second.anomalies
    assert [(a.module, a.phase) for a in found] == [("dec", "backward")]
    assert first.anomalies == [] and first.errors == second.errors == 0


def test_closing_removes_the_gradient_hooks_left_on_a_learned_input():
    """A leaf input (a parameter fed to a module) keeps its tensor hooks across steps: each
    watch() and close() left one more, keeping its closed monitor alive."""
    model, x = Queries(), torch.randn(3, 4)
    for _ in range(3):
        monitor = breakpod.watch(model)
        model(x).sum().backward()
        monitor.step()
        monitor.close()
    assert not model.q._backward_hooks


@pytest.mark.parametrize("loss", [torch.tensor([]), {"loss": torch.tensor(1.0)}, "1.0"])
@pytest.mark.parametrize("late", [False, True], ids=["step-ends", "optimizer-ends"])
def test_a_loss_with_no_value_or_of_the_wrong_type_raises_no_false_alarm(loss, late, capfd):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = breakpod.watch(model, optimizer=opt if late else None)
    for _ in range(2):
        model(torch.randn(3, 2)).sum().backward()
        if late:  # the loss after the optimizer ended the step
            opt.step()
        monitor.step(loss)
    assert monitor.flush() == [] and monitor.anomalies == [] and monitor.errors == 0
    said = capfd.readouterr().err
    if not isinstance(loss, torch.Tensor):
        assert said.count(f"is a {type(loss).__name__}; expected a tensor or a number") == 1


class MaskFirst(nn.Module):
    """Returns ``(mask, values)``: its first tensor is no value to judge."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bad = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x) * (math.nan if self.bad else 1.0)
        return y > 0, y


class UsesMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = MaskFirst()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask, y = self.first(x)
        return self.head(y * mask)


def test_an_output_whose_first_tensor_is_a_mask_is_judged_on_its_values():
    model = UsesMask()

    def forward(step: int) -> torch.Tensor:
        model.first.bad = step == 1
        return model(torch.randn(2, 4))

    assert first_nonfinite(model, forward) == (1, "first", "forward")


class CalledByKeyword(nn.Module):
    """Calls its layer as layer(hidden_states=h), as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layer = KeywordLayer()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(hidden_states=self.embed(x)))


class KeywordLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = BadGrad.apply(hidden_states) if self.bad else hidden_states
        return self.fc(h)


def test_a_backward_nan_in_a_module_called_by_keyword_names_it():
    """Only positional inputs got a gradient hook: the NaN went to the parameters of the
    module before."""
    model = CalledByKeyword()

    def forward(step: int) -> torch.Tensor:
        model.layer.bad = BadGrad.on = step == 1
        return model(torch.randn(2, 4))

    assert first_nonfinite(model, forward) == (1, "layer", "backward")


class NanInBackward(nn.Module):
    """Passes its input on; its backward makes the gradient NaN when ``bad``."""

    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bad:
            return x * 1.0
        BadGrad.on = True
        return BadGrad.apply(x)


def test_a_backward_nan_after_an_in_place_activation_names_the_module_that_made_it():
    """SiLU(inplace=True) returns its input, whose node is then SiLU's own: it hooked the
    gradient of its output, took the tensor's one hook from the module after it, and
    was blamed for that module's NaN."""
    model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(inplace=True), NanInBackward(), nn.Linear(8, 1))

    def forward(step: int) -> torch.Tensor:
        model[2].bad = step == 1
        return model(torch.randn(6, 4))

    assert first_nonfinite(model, forward) == (1, "2", "backward")


def test_an_attention_mask_of_minus_inf_is_no_bad_batch():
    """A causal mask holds -inf by design: only the model's first argument is the batch."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    monitor = breakpod.watch(model)
    for _ in range(3):
        model(torch.randn(2, 5, 16), mask).sum().backward()
        monitor.step()
    assert monitor.flush() == [] and monitor.anomalies == [] and monitor.errors == 0


def test_batchnorm_statistics_of_mixed_dtypes_read_as_each_alone():
    """The running statistics of every BatchNorm in a few foreach ops, the same values as
    a module at a time: NaN kept, and modules of two dtypes (a half-precision head)."""
    from breakpod._monitor import checks

    torch.manual_seed(0)
    modules = [torch.nn.BatchNorm2d(c) for c in (3, 8, 16)] + [torch.nn.BatchNorm1d(4).half()]
    for m in modules:
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    modules[1].running_var[2] = float("nan")
    each = [
        torch.stack([*torch.aminmax(m.running_mean), *torch.aminmax(m.running_var)]).float()
        for m in modules
    ]
    got = checks.batchnorm_stats(modules)
    assert torch.equal(got.nan_to_num(7.0), torch.cat(each).nan_to_num(7.0))
    assert torch.equal(
        checks.batchnorm_stats(modules[:3]).nan_to_num(7.0), torch.cat(each[:3]).nan_to_num(7.0)
    )


def test_a_spike_through_many_modules_is_one_anomaly_naming_the_worst_and_the_others(capfd):
    """A loss 1000x for one step makes every group's gradient norm explode: one anomaly (one
    line, one event, one park), at the group furthest past its limit, the others named
    in details; three groups or fewer are each their own, as above."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(12)])
    monitor = breakpod.watch(model, replay=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(12):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean() * (1000.0 if step == 9 else 1.0)
        optimizer.zero_grad()
        loss.backward()
        monitor.step(loss)
        optimizer.step()
    monitor.flush()
    spikes = [a for a in monitor.anomalies if a.check == "grad_norm"]
    assert len(spikes) == 1, [str(a) for a in spikes]
    (spike,) = spikes
    assert spike.step == 9 and spike.details["kind"] == "exploding"
    assert spike.details["groups_out"] == 12 and len(spike.details["groups"]) == 12
    assert spike.details["groups"][0] == spike.module
    assert "11 more groups at this step (" in spike.summary
    err = capfd.readouterr().err
    assert err.count("[grad_norm]") == 1
    monitor.close()


def test_the_grouped_anomaly_names_the_group_furthest_past_its_limit():
    """Eight modules' norms jump at step 20, module 3's the most (10000x; the others 1000x):
    it is the anomaly's module, whatever its place in the model."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(7)], nn.Linear(8, 4))
    detector, step0 = synthetic(model)
    found = []
    for step in range(21):
        data = step0.scaled(step, 1000.0 if step == 20 else 1.0)
        if step == 20:
            data.grads = {i: n * (10.0 if i in (6, 7) else 1.0) for i, n in data.grads.items()}
        found += detector.run(data)
    spikes = [a for a, _ in found if a.check == "grad_norm"]
    assert [(a.step, a.module) for a in spikes] == [(20, "3")]
    assert spikes[0].details["groups"][0] == "3" and spikes[0].details["groups_out"] == 8
