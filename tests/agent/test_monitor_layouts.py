"""Modules whose outputs are not dense strided tensors: checked through their values.

A stock ``nn.TransformerEncoder`` evaluated with a padding mask runs its layers
on nested tensors; sparse and MKL-DNN outputs and meta tensors (shape
inference) are rarer. Each made every hook of the monitor fail.
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
