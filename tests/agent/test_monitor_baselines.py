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
    assert math.isnan(float(base.log_base()[0]))  # two finite steps since the inf
    base.judge({0: 0.9})
    assert float(base.log_base()[0].exp()) == pytest.approx(1.0)
    verdicts, _ = base.judge({0: 0.001})
    assert verdicts[0][0] == "vanishing"


def test_a_calm_warm_up_keeps_its_baseline():
    base = _baselines()
    for norm in (1.0, 3.0, 2.0):
        base.judge({0: norm})
    assert float(base.log_base()[0].exp()) == pytest.approx(2.0)
    verdicts, _ = base.judge({0: 500.0})
    assert verdicts[0][0] == "exploding"


def test_a_group_whose_gradients_were_gone_from_the_start_takes_no_baseline():
    """A 200-layer MLP's first layers: norms of 1e-23 through the warm-up, then 0 (an
    underflow). "0 is 0x its baseline 4e-23" is no news: no baseline, no vanishing."""
    base = _baselines()
    for norm in (4e-23, 3e-23, 5e-23, 4e-23):
        base.judge({0: norm})
    assert math.isnan(float(base.log_base()[0]))
    verdicts, _ = base.judge({0: 0.0})
    assert verdicts == {}


def test_a_group_gone_from_the_start_warms_up_again_only_when_its_gradient_returns(
    monkeypatch,
):
    """Norms of exactly 0 never give a baseline: the first warm-up's median finds the
    group gone, and no other median is taken while it stays so; once its norm is back,
    it warms up afresh from that step."""
    base = _baselines(warmup=5)
    medians = []
    quantile = torch.quantile
    monkeypatch.setattr(torch, "quantile", lambda *a, **k: medians.append(1) or quantile(*a, **k))
    for _ in range(48):
        base.judge({0: 0.0})
    assert len(medians) == 1
    for norm in (1e-23, 1.0, 1.1, 0.9, 1.0):  # a group that comes alive takes one...
        base.judge({0: norm})
    assert math.isnan(float(base.log_base()[0]))  # ...a warm-up's worth after it is back
    verdicts, _ = base.judge({0: 1.05})
    assert verdicts == {}
    assert float(base.log_base()[0].exp()) == pytest.approx(1.0)
    assert len(medians) == 2


def test_an_exploding_warm_up_is_judged_again_once_per_warm_up(monkeypatch):
    """A warm-up that explodes gives no baseline, and is looked at again once per
    warm-up's worth of steps, not on every step."""
    base = _baselines(warmup=5)
    medians = []
    quantile = torch.quantile
    monkeypatch.setattr(torch, "quantile", lambda *a, **k: medians.append(1) or quantile(*a, **k))
    for step in range(50):
        base.judge({0: 10.0 ** (step % 5)})  # 1 ... 1e4, over and over
    assert len(medians) == 10
    assert math.isnan(float(base.log_base()[0]))


def _three_groups() -> list[NormBaselines]:
    rule = parse_rule({"check": "grad_norm", "warmup_steps": 3}, 0)
    params = [
        ParamInfo(f"{module}.{kind}", module, frozenset({rule.name}))
        for module in ("a", "b", "c")
        for kind in ("weight", "bias")
    ]
    by_floats, by_vector = (NormBaselines(rule, params) for _ in range(2))
    by_vector._few = False  # its usual step in vector ops, never in floats
    return [by_floats, by_vector]


def _judged_both_ways(
    steps: list[torch.Tensor],
) -> tuple[dict[tuple[int, int], str], int, int]:
    """Each step judged from the floats and from the vector, which must agree; what was
    said (step, group) -> kind, how many steps took the quiet path, and how many of those
    the floats' judged in floats (once every group had its baseline)."""
    by_floats, by_vector = _three_groups()
    keys = [5, 3, 1, 0, 2, 4]  # a plan's order: not the parameters' own
    quiet, in_floats, said = 0, 0, {}
    for step, norms in enumerate(steps):
        floats = {i: float(norms[i]) for i in range(6)}
        beyond = _beyond_bounds(by_vector, norms)  # what the device's mirror would say
        got = by_vector.judge(floats, [(keys, norms[keys])])
        assert by_floats.judge(floats) == got
        assert beyond == set(got.out_of_range), step
        quiet += got.seen is by_vector._seen_all
        in_floats += by_floats._floats is not None
        close(by_floats.log_base(), by_vector.log_base())
        said.update({(step, g): verdict[0] for g, verdict in got.out_of_range.items()})
    return said, quiet, in_floats


def _beyond_bounds(baselines: NormBaselines, norms: torch.Tensor) -> set[int]:
    """The groups whose finite norm is outside ``bounds()`` (norm_limits.py's test)."""
    group = torch.zeros(len(baselines.names), dtype=torch.float64)
    group.index_add_(0, baselines.group_of, norms.double().square()).sqrt_()
    above, below = baselines.bounds()
    out = torch.isfinite(group) & ((group > above) | (group < below))
    return set(out.nonzero().flatten().tolist())


def _steps(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(6, generator=gen, dtype=torch.float64) + 0.5 for _ in range(count)]


def test_the_norm_vector_and_the_quiet_step_judge_as_the_floats_do():
    """A step's norms as the host floats (a dict) and as the plan's vector (its own,
    permuted, index list, the same object each step) give the same verdicts and the
    same baselines, through warm-up, quiet steps, a spike, a dip, a NaN and a zero."""
    steps = _steps(12)
    steps[6][2] = 400.0  # b.weight explodes
    steps[8][4] = 1e-6  # c's norm dips...
    steps[8][5] = 1e-6  # ...both its parameters
    steps[9][0] = math.nan
    steps[10][1] = 0.0  # a.bias has a zero gradient: a's norm stays positive
    said, quiet, in_floats = _judged_both_ways(steps)
    assert said == {(6, 1): "exploding", (8, 2): "vanishing"}
    assert quiet >= 8  # the warm-up and the healthy steps took the quiet path
    assert in_floats >= 3  # the healthy steps after the warm-up, in floats


def test_a_group_that_never_takes_a_baseline_leaves_the_others_quiet():
    """c's gradients are gone (1e-23, then 0): no baseline, no word, and a's spike is
    still said."""
    steps = _steps(14)
    for i, norms in enumerate(steps):
        norms[4] = norms[5] = 1e-23 if i < 7 else 0.0
    steps[10][0] = 300.0
    said, quiet, in_floats = _judged_both_ways(steps)
    assert said == {(10, 0): "exploding"}
    assert quiet >= 10
    assert in_floats == 0  # c is gone: the vectors judge every step


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The float path's exp and log are Python's, the vectors' torch's: an ulp apart."""
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0, equal_nan=True)


def test_a_parameter_missing_from_the_vector_is_judged_from_the_floats():
    by_floats, by_vector = _three_groups()
    for step in range(6):
        floats = {i: 1.0 + 0.1 * i + 0.01 * step for i in range(6)}
        if step == 5:
            del floats[3]  # b.bias had no gradient this step
        keys = sorted(floats)
        vector = torch.tensor([floats[k] for k in keys], dtype=torch.float64)
        assert by_floats.judge(floats) == by_vector.judge(floats, [(keys, vector)])
    close(by_floats.log_base(), by_vector.log_base())
