"""Tensors other than dense float32-like ones, and passes that are not the step's.

A stock ``nn.TransformerEncoder`` evaluated with a padding mask runs its layers
on nested tensors; sparse and MKL-DNN outputs, meta tensors (shape inference),
complex and float8 tensors and torch.func transforms are rarer. Each made the
monitor's hooks or its step boundary fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import breakpod


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "detailed")  # the per-module hooks' tests


def convert(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sparse_coo":
        return x.to_sparse()
    if kind == "sparse_csr":
        return x.to_sparse_csr()
    if kind == "mkldnn":
        return x.to_mkldnn()
    layout = torch.jagged if kind == "jagged" else torch.strided
    return torch.nested.nested_tensor([x[0, :5], x[1, :7]], layout=layout)


class Odd(nn.Module):
    """Returns its input in another layout; NaN in one value when ``bad``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.bad = kind, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.reshape(2, -1) * 1.0
        if self.bad:
            y[1, 3] = math.nan
        return convert(y, self.kind)


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.odd = Odd(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.fc(x))


def test_a_jagged_nested_output_keeps_its_own_shape():
    model = Net("jagged")
    monitor = breakpod.watch(model)
    with torch.no_grad():
        model(torch.randn(2, 8))
    monitor.step()
    assert monitor.errors == 0
    assert str(monitor.shapes["odd"][1]).startswith("torch.Size([2, j")  # its ragged dim


KINDS = ["sparse_coo", "sparse_csr", "nested", "jagged"]
if torch.backends.mkldnn.is_available():
    KINDS.append("mkldnn")


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_value_in_an_output_of_another_layout_is_found(kind):
    model = Net(kind)
    monitor = breakpod.watch(model, [{"check": "nonfinite"}], config={"defaults": False})
    with torch.no_grad():
        for step in range(4):
            model.odd.bad = step == 2
            model(torch.randn(2, 8))
            monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert [(a.step, a.module) for a in found] == [(2, "odd")]
    assert monitor.errors == 0
    monitor.close()


class Meta(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, device="meta")  # a shape-inference pass: no values


def test_a_meta_output_holds_no_values_and_breaks_nothing():
    model = nn.Sequential(nn.Linear(8, 8), Meta())
    monitor = breakpod.watch(model)
    with torch.no_grad():
        model[0].bias[2] = math.nan
        model(torch.randn(2, 8))
    monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert {(a.module, a.phase) for a in found if a.check == "nonfinite"} == {("0", "forward")}
    assert monitor.errors == 0
    assert monitor.shapes["1"] == ([torch.Size([2, 8])], torch.Size([2, 8]))
    monitor.close()


def test_a_transformer_evaluated_with_a_padding_mask_runs_on_nested_tensors_unharmed():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    monitor = breakpod.watch(model)
    x, mask = torch.randn(4, 10, 32), torch.zeros(4, 10, dtype=torch.bool)
    mask[1:, 7:] = True  # padding: the encoder packs the batch into a nested tensor
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            model(x, src_key_padding_mask=mask)
            monitor.step()
        model.layers[1].linear2.bias[0] = math.inf
        model(x, src_key_padding_mask=mask)
        monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert monitor.errors == 0
    first = next(a for a in found if a.check == "nonfinite")
    assert (first.step, first.module) == (2, "layers.1.linear2")
    assert monitor.shapes["layers.1.linear2"][1] == (4, -1, 32)  # ragged: one is longer
    monitor.close()


class Complex(nn.Module):
    """A spectral layer's shape: complex in the middle, real out; NaN in the imaginary
    part when ``bad``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.fft(self.fc(x))
        if self.bad:
            z = z + torch.complex(torch.zeros(()), torch.tensor(math.nan))
        return z


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spec = Complex()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.spec(x).abs())


def test_a_complex_output_and_its_gradients_are_checked_as_their_real_and_imaginary_parts():
    """A complex tensor made every step boundary fail (torch's float32 norm refuses it):
    no step was ever judged."""
    torch.manual_seed(0)
    model = Spectral()
    monitor = breakpod.watch(model)
    for step in range(4):
        model.spec.bad = step == 2
        model(torch.randn(4, 8)).sum().backward()
        monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert monitor.errors == 0 and monitor.step_count == 4
    first = next(a for a in found if a.check == "nonfinite")
    assert (first.step, first.module, first.phase) == (2, "spec", "forward")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_output_is_checked_in_float32(dtype):
    class Cast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype)

    model = nn.Sequential(nn.Linear(8, 8), Cast())
    monitor = breakpod.watch(model, [{"check": "nonfinite"}], config={"defaults": False})
    with torch.no_grad():
        for step in range(3):
            model(torch.full((2, 8), math.inf if step == 1 else 1.0))
            monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert monitor.errors == 0
    assert [(a.step, a.module) for a in found] == [(1, "0")]  # Linear(inf) -> inf, then cast


def test_hooks_stand_aside_inside_torch_func_transforms():
    """vmap, grad and jacrev over a watched model: their tensors are not the step's, and
    their hooks' writes were refused (an error per hook, and a lost step)."""
    from torch.func import functional_call, grad, jacrev, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    monitor = breakpod.watch(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).sum()

    vmap(model)(torch.randn(5, 3, 4)).sum().backward()
    grad(loss)(params, torch.randn(3, 4))
    jacrev(loss)(params, torch.randn(3, 4))
    monitor.step()
    for step in range(1, 4):
        with torch.no_grad():
            model[2].bias.fill_(math.nan if step == 3 else 0.0)
        model(torch.randn(3, 4)).sum().backward()
        monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert monitor.errors == 0 and monitor.step_count == 4
    first = next(a for a in found if a.check == "nonfinite")
    assert (first.step, first.module) == (3, "2")


def test_modules_called_directly_after_a_transformed_pass_are_checked():
    """Per-sample gradients with torch.func, then the submodules called one by one: the
    hooks stood aside until the model's next forward."""
    from torch.func import functional_call, grad, vmap

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    monitor = breakpod.watch(model, [{"check": "nonfinite"}], config={"defaults": False})
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).sum()

    vmap(grad(loss), (None, 0))(params, torch.randn(3, 4))
    x = torch.randn(3, 4)
    x[0, 0] = math.nan
    model[1](model[0](x)).sum().backward()
    monitor.step()
    found = monitor.flush() or monitor.anomalies
    assert [(a.module, a.phase) for a in found][:1] == [("0", "forward")]
    assert monitor.errors == 0
