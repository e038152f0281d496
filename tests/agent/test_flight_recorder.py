"""The flight recorder: the last K steps of every watched module, read only when dumped."""

from __future__ import annotations

import math
import random
import re
import statistics

import pytest

torch = pytest.importorskip("torch")

import breakpod  # noqa: E402
from breakpod._core import events  # noqa: E402
from breakpod._monitor.flight import recorder as flight  # noqa: E402
from breakpod._monitor.flight import table as flight_table  # noqa: E402


@pytest.fixture(autouse=True)
def _detailed(monkeypatch):
    """The flight recorder's per-module rows come from the detailed tier's hooks."""
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "detailed")


NAN_EVENT = [{"name": "nan", "check": "nonfinite", "action": "event"}]


class Scaled(torch.nn.Module):
    """Its output is multiplied by ``factor`` (1 until a test makes it bad)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.factor = 1.0

    def forward(self, h):
        return self.lin(h) * self.factor


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), Scaled(), torch.nn.Linear(8, 1)
    )


def train(model, monitor, opt, steps, bad_at=None, factor=math.nan):
    for step in range(steps):
        if step == bad_at:
            model[2].factor = factor
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)


def watched(rules=NAN_EVENT, **env):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, breakpod.watch(model, rules, optimizer=opt, sink=lambda a: None)


def first_bad(monitor):
    return monitor.flight.dump().fields()["first_bad"]


def test_an_injected_nan_is_named_at_its_module_and_step():
    model, opt, monitor = watched()
    train(model, monitor, opt, 12, bad_at=7)
    rows = first_bad(monitor)
    assert (rows[0]["module"], rows[0]["phase"], rows[0]["step"], rows[0]["why"]) == (
        "2",
        "forward",
        7,
        "nan",
    )
    # the trend: the steps before it were finite, the bad one is the last shown
    assert rows[0]["trend_steps"] == [1, 2, 3, 4, 5, 6, 7]
    assert all(math.isfinite(v) for v in rows[0]["rms"][:-1]) and math.isnan(rows[0]["rms"][-1])
    # upstream modules were fine at step 7: nothing earlier than the culprit is named
    assert not [r for r in rows if r["step"] < 7]
    assert "2.lin" not in {r["module"] for r in rows if r["step"] == 7 and r["phase"] == "forward"}
    table = "\n".join(flight_table.lines(monitor.flight.dump().fields()))
    assert "steps 0-11 (12 kept)" in table and re.search(r"\n  2 +forward +step 7 ", table), table
    monitor.close()


def test_an_infinity_and_a_jump_are_told_apart_from_nan():
    model, opt, monitor = watched()
    train(model, monitor, opt, 8, bad_at=5, factor=math.inf)
    assert first_bad(monitor)[0]["why"] in ("+inf", "-inf")
    monitor.close()

    model, opt, monitor = watched()
    train(model, monitor, opt, 10, bad_at=6, factor=1e4)  # finite, far out of range
    row = first_bad(monitor)[0]
    assert (row["module"], row["step"]) == ("2", 6), row
    assert row["why"].startswith("max|x| ") and "x median" in row["why"], row
    monitor.close()


def test_the_ring_keeps_the_last_k_steps(monkeypatch):
    monkeypatch.setenv(flight.FLIGHT_ENV, "8")
    model, opt, monitor = watched()
    train(model, monitor, opt, 20)
    dump = monitor.flight.dump()
    assert dump.steps == list(range(12, 20))
    loss = next(s for s in dump.series if s.phase == "loss")
    assert loss.steps == dump.steps and all(math.isfinite(v) for v in loss.rms)
    assert dump.fields()["first_bad"] == []
    assert "every watched tensor stayed finite" in "\n".join(flight_table.lines(dump.fields()))
    monitor.close()


def test_off_means_no_columns_and_no_ring(monkeypatch):
    monkeypatch.setenv(flight.FLIGHT_ENV, "0")
    model, opt, monitor = watched()
    train(model, monitor, opt, 3)
    assert monitor.flight is None
    assert all(not s.flight and s.width == s.rule_width for s in monitor._slots)
    assert monitor._table.width == sum(s.rule_width for s in monitor._slots)
    monitor.close()


def test_a_bad_setting_is_said_and_the_default_kept(capfd):
    assert flight.flight_steps({flight.FLIGHT_ENV: "lots"}) == flight.DEFAULT_STEPS
    assert flight.flight_steps({flight.FLIGHT_ENV: "-3"}) == flight.DEFAULT_STEPS
    assert flight.flight_steps({flight.FLIGHT_ENV: "10000000"}) == flight.MAX_STEPS
    assert flight.flight_steps({flight.FLIGHT_ENV: " 0 "}) == 0
    err = capfd.readouterr().err
    assert f"keeps too many steps in device memory; keeping {flight.MAX_STEPS}" in err
    assert "BREAKPOD_FLIGHT_STEPS='lots' is not an integer" in err
    assert "BREAKPOD_FLIGHT_STEPS='-3' is negative" in err


def test_a_module_called_twice_in_a_step_records_both_calls():
    """Micro-batches: the norm and the extremes cover every call of the step."""
    lin = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(lin)
    monitor = breakpod.watch(model, NAN_EVENT, sink=lambda a: None)
    a, b = torch.randn(8, 4), torch.randn(8, 4) * 10
    with torch.no_grad():
        outs = torch.cat([lin(a), lin(b)])
    model(a).sum().backward()
    model(b).sum().backward()
    monitor.step()
    series = next(s for s in monitor.flight.dump().series if s.phase == "forward")
    assert series.rms[0] == pytest.approx(float(outs.pow(2).mean().sqrt()), rel=1e-5)
    assert series.max_abs[0] == pytest.approx(float(outs.abs().max()), rel=1e-6)
    monitor.close()


def test_anomaly_events_carry_the_dump():
    seen = []
    events.add_sink(seen.append)
    try:
        model, opt, monitor = watched()
        train(model, monitor, opt, 6, bad_at=4)
    finally:
        events.remove_sink(seen.append)
    anomalies = [e for e in seen if e.kind == "anomaly"]
    assert anomalies, [e.kind for e in seen]
    dump = anomalies[0].fields["flight"]
    assert dump["first_bad"][0]["module"] == "2" and dump["first_bad"][0]["step"] == 4
    assert dump["kept"] == 5  # read at the anomaly's step, before the next step
    monitor.close()


def test_the_event_form_is_capped_and_counts_the_rest():
    series = [flight_table.Series(f"m{i}", "forward") for i in range(40)]
    for i, s in enumerate(series):
        s.add(1, i, 1.0, 1.0, "")
        s.add(2, i, math.nan, math.nan, "nan")
    fields = flight_table.Flight([1, 2], [0.01], series).fields(limit=32)
    assert len(fields["first_bad"]) == 32 and fields["more"] == 8
    assert fields["first_bad"][0]["module"] == "m0"  # execution order within the step
    assert "... and 8 more" in flight_table.lines(fields)[-1]


def test_bf16_outputs_are_recorded():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16)
    monitor = breakpod.watch(model, NAN_EVENT, sink=lambda a: None)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    monitor.step()
    series = [s for s in monitor.flight.dump().series if s.phase == "forward"]
    assert series and math.isfinite(series[0].rms[0]) and series[0].max_abs[0] > 0
    monitor.close()


def test_a_stall_event_carries_the_dump_and_a_failing_dump_is_contained(monkeypatch):
    seen = []
    events.add_sink(seen.append)
    try:
        model, opt, monitor = watched()
        train(model, monitor, opt, 3)
        events.emit("stall", seconds=12.0, step=3)  # what the watchdog emits
        monkeypatch.setattr(monitor.flight, "dump", lambda *a, **k: 1 / 0)
        train(model, monitor, opt, 1)  # a new step: the cached dump is stale
        events.emit("stall", seconds=13.0, step=4)
    finally:
        events.remove_sink(seen.append)
    first, second = [e for e in seen if e.kind == "stall"]
    assert first.fields["seconds"] == 12.0 and first.fields["flight"]["kept"] == 3
    assert second.fields == {"seconds": 13.0, "step": 4}  # delivered, without the dump
    monitor.close()


def test_a_dump_of_the_wrong_shape_is_read_as_far_as_it_goes():
    """What the CLI reads back from an event is an agent's word: never a traceback."""
    garbage = [
        {},
        {"steps": "0-4"},
        {"steps": [0, 4], "first_bad": "x", "step_seconds": "slow"},
        {"steps": [0, 4], "step_seconds": {"median": "slow"}},
        {"steps": [0, 4], "first_bad": [1, None, {"module": None, "rms": "nan"}]},
        {"steps": [0, 4], "first_bad": [{"module": "<b>", "rms": [1, "nan", None, {}]}]},
    ]
    for fields in garbage:
        out = flight_table.lines(fields)
        assert out and all(isinstance(line, str) for line in out)
    assert "<model>" in "\n".join(flight_table.lines(garbage[4]))


class Routed(torch.nn.Module):
    """Two branches whose order in the forward follows ``flip`` (data-dependent routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.flip = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        return second(first(x))


def test_each_step_keeps_its_own_execution_order():
    """The same modules and sizes in another order: the row says the new order."""
    model = Routed()
    monitor = breakpod.watch(model, NAN_EVENT, sink=lambda a: None)
    for flip in (False, True):
        model.flip = flip  # the input needs a gradient: both branches have theirs
        model(torch.randn(8, 4, requires_grad=True)).sum().backward()
        monitor.step()
    forward = {s.module: s.when for s in monitor.flight.dump().series if s.phase == "forward"}
    monitor.close()
    assert forward["a"][0] < forward["b"][0]  # step 1: a, then b
    assert forward["b"][1] < forward["a"][1]  # step 2: b, then a


def first_bad_by_definition(series: flight_table.Series) -> tuple[int, str] | None:
    """The docstring's definition, step by step: the first non-finite step, or the first
    whose max |x| is over JUMP x the median of the finite ones before (BASELINE or more)."""
    for i, kind in enumerate(series.kinds):
        if kind:
            return i, kind
        before = [v for v in series.max_abs[:i] if math.isfinite(v)]
        if len(before) >= flight_table.BASELINE and series.phase != "loss":
            median = statistics.median(before)
            value = series.max_abs[i]
            if median > 0 and value > flight_table.JUMP * median:
                return i, f"max|x| {value:.3g} = {value / median:.0f}x median"
    return None


def test_the_first_bad_step_is_the_definitions_on_random_series():
    rng = random.Random(7)
    values = [0.0, 1.0, 2.5, 1e3, 3e5, math.inf, math.nan]
    for _ in range(2000):
        n = rng.randint(0, 40)
        series = flight_table.Series(
            "m",
            rng.choice(["forward", "backward", "loss"]),
            max_abs=[rng.choice(values) * rng.random() for _ in range(n)],
            kinds=[rng.choice([""] * 12 + ["nan", "+inf"]) for _ in range(n)],
        )
        assert series.first_bad() == first_bad_by_definition(series), series


def test_the_sentinel_tier_keeps_each_parameter_gradients_norm(monkeypatch):
    """No module is hooked in the sentinel tier: its rows are the loss and the gradient
    norm of every parameter, from the norms it computes anyway (one copy a step)."""
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "sentinel")
    model, opt, monitor = watched()
    train(model, monitor, opt, 12, bad_at=7)
    dump = monitor.flight.dump()
    grads = {s.module: s for s in dump.series if s.phase == "grad"}
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert [s.phase for s in dump.series if s.phase not in ("grad", "loss")] == []  # no hooks
    first = grads["0.weight"]
    assert first.steps == list(range(12)) and all(math.isfinite(v) for v in first.rms[:7])
    rows = first_bad(monitor)
    assert {(r["module"], r["step"], r["why"]) for r in rows if r["phase"] == "grad"} >= {
        ("0.weight", 7, "nan"),
        ("2.lin.weight", 7, "nan"),
        ("3.weight", 7, "nan"),
    }
    assert not [r for r in rows if r["step"] < 7]
    table = "\n".join(flight_table.lines(monitor.flight.dump().fields()))
    assert "0.weight" in table and "grad" in table, table
    monitor.close()


def test_a_gradient_norm_far_out_of_range_is_named_as_one(monkeypatch):
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "sentinel")
    model, opt, monitor = watched()
    train(model, monitor, opt, 10, bad_at=6, factor=1e4)  # finite, far out of range
    rows = {r["module"]: r for r in first_bad(monitor) if r["phase"] == "grad"}
    assert rows["0.weight"]["step"] == 6 and rows["0.weight"]["why"].startswith("|g| "), rows
    monitor.close()
