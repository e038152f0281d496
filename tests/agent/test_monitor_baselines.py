"""The gradient-norm baseline is never learned from a warm-up that already explodes."""

from __future__ import annotations

import math

import pytest
import torch

import breakpod
from breakpod._monitor.baselines import NormBaselines
from breakpod._monitor.detect import ParamInfo
from breakpod._monitor.rules import parse_rule
from tests.agent.nets import Net, train


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def test_an_exploding_warm_up_gives_no_baseline_and_no_vanishing(capfd):
    """lr=100: norms 0.08, 5.9, 1e4, 4.5e5, 1.4e8, then the network is dead (norm 0): the
    warm-up's median made every later step "vanishing"."""
    model = Net()
    monitor = breakpod.watch(model)
    train(model, monitor, 12, lr=100.0)
    monitor.close()
    kinds = [a.details["kind"] for a in monitor.anomalies if a.check == "grad_norm"]
    assert "vanishing" not in kinds, [str(a) for a in monitor.anomalies]
    err = capfd.readouterr().err
    assert "grad_norm rule 'grad_norm': no baseline yet for fc1, fc2, fc3: the gradient" in err
    assert err.count("no baseline yet") == 1


def _baselines(warmup: int = 3) -> NormBaselines:
    rule = parse_rule({"check": "grad_norm", "warmup_steps": warmup}, 0)
    return NormBaselines(rule, [ParamInfo("fc.weight", "fc", frozenset({rule.name}))])


def test_a_warm_up_that_goes_nonfinite_starts_again():
    base = _baselines()
    for norm in (1.0, 1.1, math.inf, 1.0, 1.2):
        base.judge({0: norm})
    assert math.isnan(float(base._log_base[0]))  # two finite steps since the inf
    base.judge({0: 0.9})
    assert float(base._log_base[0].exp()) == pytest.approx(1.0)
    verdicts, _ = base.judge({0: 0.001})
    assert verdicts[0][0] == "vanishing"


def test_a_calm_warm_up_keeps_its_baseline():
    base = _baselines()
    for norm in (1.0, 3.0, 2.0):
        base.judge({0: norm})
    assert float(base._log_base[0].exp()) == pytest.approx(2.0)
    verdicts, _ = base.judge({0: 500.0})
    assert verdicts[0][0] == "exploding"


def test_a_group_whose_gradients_were_gone_from_the_start_takes_no_baseline():
    """A 200-layer MLP's first layers: norms of 1e-23 through the warm-up, then 0 (an
    underflow). "0 is 0x its baseline 4e-23" is no news: no baseline, no vanishing."""
    base = _baselines()
    for norm in (4e-23, 3e-23, 5e-23, 4e-23):
        base.judge({0: norm})
    assert math.isnan(float(base._log_base[0]))
    verdicts, _ = base.judge({0: 0.0})
    assert verdicts == {}


def test_a_group_without_a_baseline_is_judged_again_once_per_warm_up(monkeypatch):
    """Norms of exactly 0 never give a baseline: their window's median is taken once per
    warm-up's worth of steps, not on every step."""
    base = _baselines(warmup=5)
    medians = []
    quantile = torch.quantile
    monkeypatch.setattr(torch, "quantile", lambda *a, **k: medians.append(1) or quantile(*a, **k))
    for _ in range(50):
        base.judge({0: 0.0})
    assert len(medians) == 10
    for norm in (1.0, 1.1, 0.9, 1.0, 1.05):  # a group that comes alive takes one
        base.judge({0: norm})
    assert float(base._log_base[0].exp()) == pytest.approx(1.0)
