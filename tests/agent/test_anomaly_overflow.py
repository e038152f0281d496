"""Non-finite means NaN or Inf in the values: a finite tensor whose L2 norm (or sum)
overflows float32 is an ``overflow``, named so, never listed in ``nonfinite_params``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import breakpod


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.setenv("BREAKPOD_FLIGHT_STEPS", "0")  # the kind read from the values alone
    torch.manual_seed(0)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _step(model: nn.Module, monitor: breakpod.Monitor) -> None:
    x = torch.randn(4, 8)
    loss = F.mse_loss(model(x), torch.zeros(4, 1))
    loss.backward()
    monitor.step(loss)


def test_a_huge_finite_weight_is_an_overflow_not_a_nonfinite_param():
    model = _model()
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}])
    with torch.no_grad():
        model[0].weight[0, 0] = 1e20  # every value finite; the L2 norm overflows float32
    _step(model, monitor)
    monitor.close()
    (a,) = monitor.anomalies
    assert a.details.get("kind") == "overflow", a
    assert "overflow" in str(a) and "non-finite" not in str(a), a
    assert "0.weight" not in a.details.get("nonfinite_params", []), a
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_huge_weight_beside_a_nan_lists_only_the_nan():
    model = _model()
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}])
    with torch.no_grad():
        model[0].weight[0, 0] = 1e20
        model[2].weight[0, 0] = float("nan")
    _step(model, monitor)
    monitor.close()
    (a,) = monitor.anomalies
    assert a.module == "2" and "overflow" not in str(a), a
    assert a.details["nonfinite_params"] == ["2.weight"], a
    assert a.details["overflow_params"] == ["0.weight"], a


def _huge_outputs(monkeypatch: pytest.MonkeyPatch, flight: str) -> breakpod.Monitor:
    monkeypatch.setenv("BREAKPOD_FLIGHT_STEPS", flight)
    model = nn.Sequential(nn.Linear(4, 64))
    with torch.no_grad():
        model[0].weight.fill_(1e36)
        model[0].bias.zero_()
    rules = [{"check": "nonfinite", "where": ["activation"], "action": "log"}]
    monitor = breakpod.watch(model, rules)
    model(torch.ones(8, 4))  # each value 4e36, finite; their float32 sum is not
    monitor.step()
    monitor.close()
    return monitor


def test_an_output_whose_sum_overflows_is_never_called_nonfinite(monkeypatch):
    """With the flight recorder's min/max the values are known finite."""
    monitor = _huge_outputs(monkeypatch, "64")
    assert all(a.details.get("kind") == "overflow" for a in monitor.anomalies), monitor.anomalies


def test_an_infinite_sum_with_nothing_else_read_says_it_may_be_an_overflow(monkeypatch):
    (a,) = _huge_outputs(monkeypatch, "0").anomalies
    assert "+inf=yes, or finite values whose sum overflows float32" in a.summary, a


def test_the_default_expiry_continues_after_an_overflow():
    from breakpod._monitor.anomaly import Anomaly, expiry_policy

    over = Anomaly("n", "nonfinite", "0", 3, "param", "overflow", 1.0, {"kind": "overflow"})
    nan = Anomaly("n", "nonfinite", "0", 3, "param", "nan", 1.0, {"nan": 1})
    assert expiry_policy(over, {}) == "continue" and expiry_policy(nan, {}) == "skip"
