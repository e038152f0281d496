"""The planned norms of parameters and gradients: the values torch gives, and few objects."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn

import breakpod
from breakpod._monitor import norms
from breakpod._monitor.norms import NormPlan


def exact(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach().float().norm() for t in tensors])


def mixed() -> list[torch.Tensor]:
    """More small tensors of one shape than a scratch block holds, a lone shape, a large
    tensor, half, bfloat16 and float64 ones of one shape, scalars, and an empty one."""
    rows = norms.SCRATCH_BYTES // (64 * 64 * 4)
    tensors = [torch.randn(64, 64) for _ in range(2 * rows + 3)]
    tensors += [torch.randn(7), torch.randn(300, 300), torch.randn(5, 3).half()]
    tensors += [torch.randn(5, 3).bfloat16(), torch.randn(5, 3).double(), torch.empty(0, 4)]
    tensors += [torch.tensor(2.0), torch.tensor(-3.0), torch.tensor(0.5).half()]
    return [tensors[i] for i in torch.randperm(len(tensors)).tolist()]


def as_dict(result: list[tuple[object, list[int], torch.Tensor]]) -> dict[int, float]:
    return {k: v for _, keys, values in result for k, v in zip(keys, values.tolist(), strict=True)}


def test_each_norm_is_torchs_and_keyed_by_position():
    tensors = mixed()
    found = as_dict(NormPlan(tensors)(tensors))
    assert sorted(found) == list(range(len(tensors)))
    expected = exact(tensors)
    for k, value in found.items():
        assert value == pytest.approx(expected[k].item(), rel=1e-5), k


def test_gradients_reuse_the_plan_of_their_parameters_and_missing_ones_are_left_out():
    params = mixed()
    plan = NormPlan(params, keys=[10 * i for i in range(len(params))])
    grads = [torch.randn_like(p) for p in params]
    missing = {0, 5, len(params) - 1}
    for i in missing:
        grads[i] = None
    found = as_dict(plan(grads))
    assert sorted(found) == [10 * i for i in range(len(params)) if i not in missing]
    expected = exact([g for g in grads if g is not None])
    present = [i for i in range(len(params)) if i not in missing]
    for position, i in enumerate(present):
        assert found[10 * i] == pytest.approx(expected[position].item(), rel=1e-5)
    assert plan([None] * len(params)) == []


@pytest.mark.parametrize("change", ["all to float64", "one layer to float32", "one resized"])
def test_parameters_changed_after_the_plan_keep_their_exact_norms(change):
    """``model.to`` after ``watch`` swaps a parameter's data, not the Parameter: a layer
    kept in float32 in a half model must not overflow half (1e5), nor a resized one fail."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)]).half()
    params = list(model.parameters())
    plan = NormPlan(params)
    plan(params)
    if change == "all to float64":
        model.double()
    elif change == "one layer to float32":
        model[7].float()
        with torch.no_grad():
            model[7].bias.fill_(1e5)
    else:
        model[3].weight.data = torch.randn(16, 8).half()
    found = as_dict(plan(params))
    expected = exact(params)
    assert found == {k: pytest.approx(expected[k].item(), rel=1e-3) for k in range(len(params))}


def test_a_nan_in_one_row_of_a_block_shows_in_its_norm_only():
    tensors = [torch.randn(8, 8) for _ in range(40)]
    tensors[17][3, 3] = float("nan")
    tensors[30][0, 0] = float("-inf")
    found = as_dict(NormPlan(tensors)(tensors))
    assert math.isnan(found[17]) and found[30] == math.inf
    assert all(math.isfinite(v) for k, v in found.items() if k not in (17, 30))


def test_a_tensor_on_another_device_than_planned_is_reduced_on_its_own():
    """A parameter moved alone after the plan (one layer to another GPU): its block cannot
    stack it, so the call groups by device, as an unplanned norm does. ``meta`` stands in
    for the other device here."""
    params = [torch.randn(4, 4) for _ in range(10)]
    grads = [torch.randn(4, 4) for _ in range(10)]
    grads[6] = torch.empty(4, 4, device="meta")
    found = {device.type: keys for device, keys, _ in NormPlan(params)(grads)}
    assert found == {"cpu": [0, 1, 2, 3, 4, 5, 7, 8, 9], "meta": [6]}


def test_sparse_gradients_take_a_norm_each():
    embedding = nn.Embedding(50, 8, sparse=True)
    others = [nn.Embedding(50, 8, sparse=True) for _ in range(3)]
    params = [embedding.weight] + [o.weight for o in others]
    for module in [embedding, *others]:
        module(torch.tensor([1, 2, 3])).sum().backward()
    grads = [p.grad for p in params]
    assert all(g.is_sparse for g in grads)
    found = as_dict(NormPlan(params)(grads))
    expected = [g.coalesce().values().norm().item() for g in grads]
    assert [found[k] for k in range(4)] == pytest.approx(expected, rel=1e-5)


def young_collections(fn) -> int:
    """How many collections of the young generation ``fn`` sets off (from an empty one)."""
    counted = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            counted.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.collect()
    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    return len(counted)


def test_norms_of_hundreds_of_small_tensors_set_off_no_collection():
    """torch's fused norm makes a tensor object per input on a CPU: 800 of them set off
    a collection in the middle of a training step. The plan makes a few per block."""
    params = list(nn.Sequential(*[nn.Linear(32, 32) for _ in range(400)]).parameters())
    plan = NormPlan(params)
    plan(params)
    assert young_collections(lambda: torch._foreach_norm(params)) >= 1  # the contrast
    assert young_collections(lambda: plan(params)) == 0


def survivors_of_a_step(monkeypatch, watched: bool, modules: int = 400) -> int:
    """Objects a step of an MLP of ``modules`` leaf modules leaves alive, but tensors
    (the step's gradients, whose count is blurred by ids reused from the step before)."""
    layers: list[nn.Module] = []
    for _ in range(modules // 2):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monkeypatch.setenv("BREAKPOD_MONITOR", "1" if watched else "0")
    monitor = breakpod.watch(model)
    x = torch.randn(8, 16)

    def step() -> None:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)

    for _ in range(3):
        step()
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    step()
    alive = [o for o in gc.get_objects() if id(o) not in before]
    monitor.close()
    return sum(1 for o in alive if not isinstance(o, torch.Tensor))


def test_a_monitored_step_leaves_no_object_per_module_behind(monkeypatch):
    """What outlives a step dies old: enough of it brings on full collections (200 ms
    and more in a process that imported torch). What a step leaves must not grow with
    the model: the hooks used to keep each module's shapes anew every step (about 380
    objects more than the same step unwatched, at 400 modules)."""
    unwatched = survivors_of_a_step(monkeypatch, watched=False)
    assert survivors_of_a_step(monkeypatch, watched=True) < unwatched + 20


def nan_gradient_found(model: nn.Module, param: nn.Parameter, x: torch.Tensor) -> list:
    """Train 3 steps, ``param``'s gradient NaN at the last; ``(step, check, module)`` of
    what the monitor found, once it is sure the monitor itself never failed."""
    monitor = breakpod.watch(model)
    for step in range(3):
        if step == 2:
            param.register_hook(lambda g: g * float("nan"))
        model.zero_grad()
        model(x).square().mean().backward()
        monitor.step()
    monitor.flush()
    assert monitor.errors == 0
    monitor.close()
    return [(a.step, a.check, a.module) for a in monitor.anomalies]


@pytest.mark.parametrize("make", ["float64", "sparse"])
def test_gradients_torchs_fused_norm_refuses_are_still_checked(monkeypatch, make):
    """A float64 model, or a sparse embedding's gradient: torch's fused norm raises on
    both, which used to fail the monitor's step boundary and end every gradient check."""
    monkeypatch.setenv("BREAKPOD_MONITOR", "1")
    embedding = nn.Embedding(20, 8, sparse=make == "sparse")
    model = nn.Sequential(embedding, nn.Flatten(), nn.Linear(16, 4))
    if make == "float64":
        model.double()
    found = nan_gradient_found(model, model[2].weight, torch.tensor([[1, 2], [3, 4]]))
    assert (2, "nonfinite", "2") in found, found


class Scaled(nn.Module):
    """A layer with two 0-d parameters (a scale and a temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.temp = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale / self.temp


def test_scalar_parameters_are_checked_and_a_read_never_raises(monkeypatch):
    monkeypatch.setenv("BREAKPOD_MONITOR", "1")
    model = Scaled()
    found = nan_gradient_found(model, model.scale, torch.randn(2, 4))
    assert (2, "nonfinite", "") in found, found


def test_a_failing_read_is_contained_in_flush(monkeypatch, capfd):
    monkeypatch.setenv("BREAKPOD_MONITOR", "1")
    model = Scaled()
    monitor = breakpod.watch(model, tier="detailed")  # the parameters' norms at each read
    model(torch.randn(2, 4)).sum().backward()
    monitor.step()

    def broken(tensors):
        raise IndexError("a plan that does not fit")

    monkeypatch.setattr(monitor, "_param_norms", broken)
    monitor.step()
    assert monitor.flush() == []
    assert monitor.errors >= 1
    assert "a plan that does not fit" in capfd.readouterr().err
    monitor.close()


def test_the_shapes_kept_follow_a_change_of_batch(monkeypatch):
    """Shapes are stored only when they change (see above), and then they are."""
    monkeypatch.setenv("BREAKPOD_MONITOR", "1")
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    monitor = breakpod.watch(model, tier="detailed")  # shapes: hooks
    for batch in (8, 8, 5):
        model(torch.randn(batch, 4)).sum().backward()
        monitor.step()
        assert monitor.shapes["0"] == ([(batch, 4)], (batch, 3))
        assert monitor.shapes["1"] == ([(batch, 3)], (batch, 3))
    monitor.close()


def test_float64_norms_are_summed_in_float64_and_planned_apart(monkeypatch):
    """Rounded to float32 first, squares of 1e19 overflow: a finite gradient would read
    as non-finite. The fused float32 norm refuses float64, so the plan never hands it
    one (it would raise, and fall back, at every step)."""
    tensors = [torch.full((4, 4), 1e19, dtype=torch.float64) for _ in range(6)]
    tensors += [torch.ones(4, 4) for _ in range(3)]
    fused = torch._foreach_norm
    handed: list[torch.dtype] = []

    def recording(ts, *args, **kwargs):
        handed.extend(t.dtype for t in ts)
        return fused(ts, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", recording)
    found = as_dict(NormPlan(tensors)(tensors))
    assert found == {k: pytest.approx(4e19 if k < 6 else 4.0, rel=1e-6) for k in range(9)}
    assert torch.float64 not in handed


def test_a_lazy_modules_parameters_are_planned_once_they_exist():
    """Watched before its first call, a lazy module's parameters cannot be read:
    watch() raised (ValueError: uninitialized parameter)."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(1))
    rules = [{"check": "nonfinite", "where": ["param"]}]
    monitor = breakpod.watch(model, rules, config={"defaults": False})
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                model[2].weight[0, 0] = math.nan
        model(torch.randn(3, 4)).sum().backward()
        monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert [(a.step, a.module) for a in found] == [(2, "2")]
    assert monitor.errors == 0


class NanWeightGrad(torch.autograd.Function):
    """x * w, whose backward makes the weight's gradient NaN (and nothing else)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad, torch.full((4,), math.nan)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanWeightGrad.apply(x, self.w) if self.bad else x * self.w


@pytest.mark.parametrize("evaluated", [False, True], ids=["", "after-an-evaluation-step"])
@pytest.mark.parametrize("replace", ["load_state_dict(assign=True)", "to_empty from meta"])
def test_parameters_replaced_after_watch_are_watched(replace, evaluated):
    """The monitor held the parameters it saw at watch(): once replaced, their gradients
    were never checked again (or, from the meta device, every step failed). A step with
    no backward before (an evaluation) must not hide the change."""
    if replace == "to_empty from meta":
        with torch.device("meta"):
            model = nn.Sequential(Scale(), nn.Linear(4, 1))
        monitor = breakpod.watch(model)
        model.to_empty(device="cpu")
        for p in model.parameters():
            nn.init.normal_(p)
    else:
        model = nn.Sequential(Scale(), nn.Linear(4, 1))
        monitor = breakpod.watch(model)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if evaluated:
        with torch.no_grad():
            model(torch.randn(3, 4))
        monitor.step()
    for step in range(int(evaluated), 3):
        model[0].bad = step == 2
        loss = model(torch.randn(3, 4)).sum()
        opt.zero_grad()
        loss.backward()
        monitor.step(loss)
        opt.step()
    found = monitor.flush() or monitor.anomalies
    assert [(a.step, a.module, a.check) for a in found][:1] == [(2, "0", "nonfinite")]
    assert "gradient of 0.w" in found[0].summary
    assert monitor.errors == 0
