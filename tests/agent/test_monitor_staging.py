"""Staged blocks: small tensors reduced a block at a time give the direct path's statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import breakpod
from breakpod._monitor import checks, staging
from breakpod._monitor.detect import HIGH, LOW, MEAN_ABS, NORM, TOTAL, ZEROS, Slot
from breakpod._monitor.stats import SlotTable


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.setenv("BREAKPOD_MONITOR_TIER", "detailed")  # the per-module hooks' tests


def slots(n: int, flight: bool = True, **flags) -> list[Slot]:
    width = 1 + sum(1 for k in ("mean_abs", "zeros") if flags.get(k)) + 3 * flight
    return [
        Slot(f"m{i}", "forward", frozenset({"r"}), index=i, base=i * width, flight=flight, **flags)
        for i in range(n)
    ]


def put(stager: staging.Stager, slot: Slot, x: torch.Tensor, nonnegative: bool = False) -> bool:
    return stager.put(slot, x, staging.unit_mode(slot, nonnegative), x.device, x.numel())


def verdict(column: torch.Tensor) -> torch.Tensor:
    """What detection reads of a non-finite signal: finite (0), NaN, +Inf or -Inf."""
    return torch.where(torch.isfinite(column), torch.zeros_like(column), column)


def direct(table: SlotTable, xs: list[torch.Tensor], nonnegative: bool) -> torch.Tensor:
    cells = table.cells(xs[0].device)
    for slot, x in zip(table.slots, xs, strict=True):
        checks.write_stats(x, cells, slot.base, *slot.flags, nonnegative=nonnegative)
    return table.buffer(xs[0].device).clone()


def staged(table: SlotTable, xs: list[torch.Tensor], nonnegative: bool) -> torch.Tensor:
    stager = staging.Stager(table)
    for slot, x in zip(table.slots, xs, strict=True):
        assert put(stager, slot, x, nonnegative)
    stager.flush()
    return table.buffer(xs[0].device).clone()


CASES = [
    ((32, 64), torch.float32, {"zeros": True}, True),  # a ReLU's output
    ((32, 64), torch.float32, {"zeros": True}, False),
    ((8, 16, 24), torch.float32, {"mean_abs": True, "zeros": True}, False),  # B,T,D
    ((4, 3, 5, 5), torch.float32, {"zeros": True, "pre_relu": True}, False),  # N,C,H,W
    ((17,), torch.float32, {"zeros": True}, False),  # one value per unit
    ((16, 32), torch.bfloat16, {"mean_abs": True}, False),
]


@pytest.mark.parametrize("flight", [True, False], ids=["flight", "no-flight"])
@pytest.mark.parametrize(("shape", "dtype", "flags", "nonnegative"), CASES)
def test_a_staged_block_gives_the_direct_statistics(shape, dtype, flags, nonnegative, flight):
    torch.manual_seed(0)
    xs = [torch.randn(shape).to(dtype) for _ in range(12)]
    if nonnegative:
        xs = [x.relu() for x in xs]
    xs[1].view(-1)[0] = math.nan
    xs[2].view(-1)[-1] = math.inf
    if not nonnegative:  # a ReLU's output is never -inf
        xs[3].view(-1)[1] = -math.inf
    xs[4].zero_()  # every unit dead
    if len(shape) > 1:
        xs[5].select(-1 if len(shape) == 3 else 1, 0).zero_()  # one dead unit
    table = SlotTable(slots(len(xs), flight, total=True, **flags))
    want = direct(table, xs, nonnegative)
    table = SlotTable(slots(len(xs), flight, total=True, **flags))
    got = staged(table, xs, nonnegative)
    # the non-finite signal: sum x, or min + max with the flight recorder (and a ReLU's
    # output staged); the same verdict and kind
    total = [s.cell(TOTAL) for s in table.slots]
    torch.testing.assert_close(verdict(got[total]), verdict(want[total]), equal_nan=True)
    # a ReLU output's staged min is its least per-unit max: >= the true min, >= 0
    low = [s.cell(LOW) for s in table.slots] if nonnegative and flight else []
    finite = torch.isfinite(want[low])
    assert (got[low][finite] >= want[low][finite]).all() and (got[low][finite] >= 0).all()
    rest = [i for i in range(len(got)) if i not in set(total) | set(low)]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[rest], want[rest], rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize(("shape", "dtype", "flags", "nonnegative"), CASES)
def test_a_step_between_reads_leaves_the_slow_columns_and_checks_the_rest(
    shape, dtype, flags, nonnegative
):
    """check_every: a lean step's block and direct path compute the non-finite signal
    and the flight columns as a full step does, and never touch mean |x| or units."""
    torch.manual_seed(0)
    xs = [torch.randn(shape).to(dtype) for _ in range(6)]
    xs = [x.relu() for x in xs] if nonnegative else xs
    xs[1].view(-1)[0], xs[2].view(-1)[-1] = math.nan, math.inf
    results = []
    for lean_step in ("direct", "staged"):
        table = SlotTable(slots(len(xs), True, total=True, **flags))
        buffer = table.buffer(xs[0].device)
        buffer.fill_(-7.0)
        stager = staging.Stager(table)
        for slot, x in zip(table.slots, xs, strict=True):
            mode = staging.unit_mode(slot, nonnegative)
            if lean_step == "direct" or not stager.put(slot, x, mode, x.device, x.numel(), True):
                cells = table.cells(x.device)
                checks.write_stats(
                    x, cells, slot.base, *slot.flags, nonnegative=nonnegative, stats=False
                )
        stager.flush()
        skipped = [c for s in table.slots for c in (s.cell(MEAN_ABS), s.cell(ZEROS)) if c >= 0]
        assert skipped and buffer[skipped].eq(-7.0).all()
        results.append(buffer.clone())
    got, want = results[1], results[0]
    total = [s.cell(TOTAL) for s in table.slots]
    torch.testing.assert_close(verdict(got[total]), verdict(want[total]), equal_nan=True)
    flight_cells = [s.cell(c) for s in table.slots for c in (NORM, LOW, HIGH)]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        got[flight_cells], want[flight_cells], rtol=tol, atol=tol, equal_nan=True
    )


def test_a_full_block_is_reduced_at_once_and_rows_are_reused(monkeypatch):
    monkeypatch.setattr(staging, "MAX_ROWS", 4)
    table = SlotTable(slots(10, total=True))
    stager = staging.Stager(table)
    xs = [torch.full((2, 3), float(i)) for i in range(10)]
    for slot, x in zip(table.slots, xs, strict=True):
        put(stager, slot, x)
    assert stager.flushes == 2  # two full blocks so far, two rows staged
    stager.flush()
    assert stager.flushes == 3
    norms = table.buffer(torch.device("cpu"))[[s.cell(NORM) for s in table.slots]]
    assert norms.tolist() == pytest.approx([math.sqrt(6) * i for i in range(10)])


def test_a_block_holds_the_rows_its_shape_needs_a_step_up_to_its_budget(monkeypatch):
    """A shape met once a step keeps a small block, not a budget's worth of memory; one
    met often grows, at a step's end, to what the step staged (up to the budget), so
    later steps reduce it in one block."""
    monkeypatch.setattr(staging, "MAX_ROWS", 30)
    monkeypatch.setattr(staging, "FIRST_ROWS", 8)
    table = SlotTable(slots(41, total=True))
    stager = staging.Stager(table)
    rare, common = torch.ones(2, 3), torch.ones(4, 5)
    flushes = []
    for step in range(3):
        before = stager.flushes
        put(stager, table.slots[0], rare)
        for slot in table.slots[1:]:
            put(stager, slot, common * step)
        stager.end_step()
        flushes.append(stager.flushes - before)
        blocks = {tuple(g.block.shape[1:]): len(g.rows) for g in stager._groups.values()}
        assert blocks == {(2, 3): 8, (4, 5): 30}  # 40 staged, 30 at most
    # first step: 5 full blocks of 8 and the rare one's; later: 30 rows, then the
    # last 10 and the rare one's at the step's end
    assert flushes == [6, 3, 3]
    values = table.buffer(torch.device("cpu"))[[s.cell(NORM) for s in table.slots[1:]]]
    assert values.tolist() == pytest.approx([math.sqrt(20) * 2] * 40)


def test_a_block_that_cannot_grow_keeps_serving(monkeypatch):
    """Out of memory at a step's end, where a block would grow: it keeps its rows, and
    the next steps are reduced in more blocks, not lost."""
    table = SlotTable(slots(41, total=True))
    stager = staging.Stager(table)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CPU out of memory (injected)")

    for step in range(3):
        for slot in table.slots:
            put(stager, slot, torch.full((4, 5), float(step)))
        if step == 0:  # the first block is made; growing it at this step's end fails
            monkeypatch.setattr(staging, "lasting", out_of_memory)
        stager.end_step()
    (group,) = stager._groups.values()
    assert len(group.rows) == staging.FIRST_ROWS
    values = table.buffer(torch.device("cpu"))[[s.cell(NORM) for s in table.slots]]
    assert values.tolist() == pytest.approx([math.sqrt(20) * 2] * 41)


def test_large_tensors_and_too_many_shapes_take_the_direct_path(monkeypatch):
    table = SlotTable(slots(3, total=True))
    stager = staging.Stager(table)
    assert not put(stager, table.slots[0], torch.zeros(staging.MAX_NUMEL + 1))
    monkeypatch.setattr(staging, "MAX_GROUPS", 1)
    assert put(stager, table.slots[1], torch.zeros(3, 4))
    assert not put(stager, table.slots[2], torch.zeros(4, 3))


def test_dropped_rows_never_reach_the_table():
    table = SlotTable(slots(2, total=True))
    stager = staging.Stager(table)
    put(stager, table.slots[0], torch.ones(2, 2))
    stager.drop()
    stager.flush()
    assert stager.flushes == 0
    assert table.cells(torch.device("cpu"))[0] == 0


def test_a_modules_later_call_adds_at_the_steps_end_and_reduces_no_block_early():
    """A shared module (or micro-batches) writes a slot again in one step: its values add
    to the first call's once that call's staged row landed, and nothing lands early."""
    table = SlotTable(slots(3, total=True))
    stager = staging.Stager(table)
    first, later = torch.ones(2, 3), torch.full((2, 3), -4.0)
    put(stager, table.slots[0], first)
    put(stager, table.slots[1], torch.zeros(2, 3))
    again = torch.zeros(table.slots[0].width)
    checks.write_stats(later, again.unbind(), 0, *table.slots[0].flags)
    stager.add(torch.device("cpu"), table.slots[0], again)
    assert stager.flushes == 0  # the row of its first call is still staged
    stager.end_step()
    cell = table.buffer(torch.device("cpu"))
    low, high = (table.slots[0].cell(c) for c in (LOW, HIGH))
    assert (cell[low], cell[high]) == (-4.0, 1.0)  # the extremes of both calls
    assert cell[table.slots[0].cell(TOTAL)] == 2.0 - 8.0  # each call's min + max, added


class AddsInPlace(nn.Module):
    """A Linear, then an in-place op on its output (as ``out += identity`` in a ResNet block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out.relu_()  # a -inf in fc's output becomes 0 here, after fc's hook saw it
        return out


def test_the_values_are_those_the_hook_saw_not_those_after_an_in_place_op():
    model = AddsInPlace()
    with torch.no_grad():
        model.fc.bias[0] = -math.inf
    monitor = breakpod.watch(model, [{"check": "nonfinite"}], config={"defaults": False})
    model(torch.randn(4, 8))
    monitor.step()
    (anomaly,) = monitor.flush() or monitor.anomalies
    assert (anomaly.module, anomaly.phase) == ("fc", "forward")
    assert anomaly.details["-inf"] == "yes"
    monitor.close()


def test_the_first_bad_module_of_many_blocks_is_named(monkeypatch):
    """More small modules than a block holds: blocks are reduced mid-forward and mid-backward,
    and the first non-finite output is still the one named."""
    monkeypatch.setattr(staging, "MAX_ROWS", 16)
    layers: list[nn.Module] = []
    for _ in range(60):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        model[70].weight[0, 0] = math.nan  # module 70 of 120: in the fifth block
    monitor = breakpod.watch(model)
    model(torch.randn(4, 8)).sum().backward()
    monitor.step()
    found = monitor.flush() or monitor.anomalies
    nonfinite = [a for a in found if a.check == "nonfinite"]
    assert [(a.module, a.phase) for a in nonfinite] == [("70", "forward")]
    assert monitor.errors == 0
    monitor.close()


class Varying(nn.Module):
    """A sequence model's shape: the length changes from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_blocks_of_shapes_no_longer_seen_are_freed_and_new_shapes_still_staged():
    model = Varying()
    monitor = breakpod.watch(model)
    stager = monitor._stager
    for length in range(1, 3 * staging.MAX_GROUPS):
        model(torch.randn(2, length, 8)).sum().backward()
        monitor.step()
        assert len(stager._groups) <= staging.MAX_GROUPS // 2 + 2  # two per step, pruned
    with torch.no_grad():
        model.fc.bias[3] = math.nan
    model(torch.randn(2, 500, 8)).sum().backward()  # a shape never seen: staged all the same
    monitor.step()
    assert torch.Size([2, 500, 8]) in {key[0] for key in stager._groups}
    found = [a for a in monitor.flush() + monitor.anomalies if a.check == "nonfinite"]
    assert found and found[0].module == "fc" and found[0].phase == "forward"
    assert monitor.errors == 0
    monitor.close()


def test_an_empty_batch_is_no_error_and_checks_nothing():
    model = Varying()
    monitor = breakpod.watch(model)
    model(torch.randn(0, 3, 8)).sum().backward()
    monitor.step()
    model(torch.randn(2, 3, 8)).sum().backward()
    monitor.step()
    monitor.flush()
    assert monitor.errors == 0 and monitor.anomalies == []
    monitor.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_staged_block_on_cuda_matches_the_cpu_and_never_syncs():
    """Rows copied, blocks reduced and written into the table on the device, with the
    index made once and kept there: no host sync, the CPU's values."""
    torch.manual_seed(0)
    xs = [torch.randn(32, 64).relu() for _ in range(40)]
    xs[7][0, 0] = math.nan
    want = staged(SlotTable(slots(len(xs), total=True, zeros=True)), xs, True)
    table = SlotTable(slots(len(xs), total=True, zeros=True))
    stager = staging.Stager(table)
    cuda = [x.cuda() for x in xs]
    for _ in range(2):  # the second pass reuses the index kept on the device
        torch.cuda.set_sync_debug_mode("error")
        try:
            for slot, x in zip(table.slots, cuda, strict=True):
                assert put(stager, slot, x, True)
            stager.flush()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    got = table.buffer(cuda[0].device).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
