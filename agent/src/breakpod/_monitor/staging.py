"""Small watched tensors reduced a block at a time, not one kernel per statistic each.

A model of hundreds of small modules pays a few µs of dispatch (a kernel
launch on a GPU) per statistic per tensor, which dwarfs the arithmetic. So a
hook copies a small tensor into a row of a staging block kept per shape,
dtype, device and dead-unit mode (one copy, no allocation, the value as it
was when the hook saw it, whatever in-place op follows), and each full block
is reduced at once: a handful of kernels over up to :data:`BLOCK_BYTES`
(:data:`CPU_BLOCK_BYTES` on a CPU) whatever the row count, whose results land
in the slot table's columns with one indexed copy. The step's end reduces
what is left. Large tensors, whose kernels cost more than their launch, keep
the direct path (:func:`~breakpod._monitor.checks.write_stats`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from breakpod._monitor import checks
from breakpod._monitor.detect import HIGH, LOW, MEAN_ABS, NORM, TOTAL, ZEROS, Slot
from breakpod._monitor.stats import SlotTable, lasting

MAX_NUMEL = 1 << 15  # larger tensors take the direct path: their kernels outweigh a launch
BLOCK_BYTES = 1 << 20  # a block's memory: rows of one shape, reduced together
# On a CPU a launch is cheap and the block is host memory held beside the job's own:
# a quarter of it costs a few more reductions per step and no measurable time.
CPU_BLOCK_BYTES = 1 << 18
MAX_ROWS = 256
# A new block's rows; at a step's end it grows to what the step staged (up to the
# budget): a shape met once a step holds a few rows, not a budget's worth of memory,
# and a shape met only in one step (a new sequence length) seldom needs to grow.
FIRST_ROWS = 32
MAX_GROUPS = 32  # distinct (shape, dtype, device, mode): more take the direct path
MAX_LAYOUTS = 256  # cached (slot order -> columns and device index) maps
LEAN_SKIPS = (MEAN_ABS, ZEROS)  # the slow conditions' columns, measured on read steps only


@dataclasses.dataclass
class _Group:
    """The staging block of one (shape, dtype, device, dead-unit mode)."""

    block: Any  # (rows, *shape)
    rows: list[Any]  # its row views, made once
    mode: str  # "" (no dead units), "pre_relu", "nonnegative" or "abs"
    most: int  # the rows its budget allows
    slots: list[Slot] = dataclasses.field(default_factory=list)
    # its rows come from a step that skips LEAN_SKIPS (a block never spans two steps:
    # the step's end reduces every block)
    lean: bool = False
    staged: int = 0  # tensors staged here since the last step's end


class Stager:
    """Staging blocks in front of one :class:`SlotTable`."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self.flushes = 0  # blocks reduced so far (tests read it)
        self._groups: dict[tuple[Any, ...], _Group] = {}
        self._later: list[tuple[Any, Slot, Any]] = []  # a module's later calls: see add
        self._layouts: dict[tuple[Any, ...], tuple[tuple[int, ...], Any, Any]] = {}
        self._busy = False  # some group holds rows

    def put(
        self, slot: Slot, x: Any, mode: str, device: Any, numel: int, lean: bool = False
    ) -> bool:
        """Stage ``x`` (detached, ``numel`` values on ``device``) for ``slot``, whose
        dead-unit ``mode`` is :func:`unit_mode`; False when it takes the direct path.
        ``lean``: this step skips the slow conditions' columns (:data:`LEAN_SKIPS`)."""
        if numel > MAX_NUMEL:
            return False
        key = (x.shape, x.dtype, device, mode)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= MAX_GROUPS:
                return False
            group = self._groups[key] = _new_group(x, mode)
        if not group.slots:
            group.lean = lean
        group.rows[len(group.slots)].copy_(x)
        group.slots.append(slot)
        group.staged += 1
        self._busy = True
        if len(group.slots) == len(group.rows):
            self._reduce(group)
        return True

    def flush(self) -> None:
        """Reduce every staged row into the table (before anything reads its buffer)."""
        if self._busy:
            for group in self._groups.values():
                if group.slots:
                    self._reduce(group)
            self._busy = False

    def add(self, device: Any, slot: Slot, values: Any) -> None:
        """A module's later call in this step (micro-batches, a shared module): its
        ``values`` add to what its first call wrote, at the step's end, once that call's
        staged row has landed; no block is reduced early for it."""
        self._later.append((device, slot, values))

    def end_step(self) -> None:
        """The step's end: reduce what is staged, and free the blocks of shapes this step
        did not use once there are many (a varying sequence length makes a new shape
        each step; its blocks must not pile up, nor keep later shapes off the fast path)."""
        self.flush()
        for device, slot, values in self._later:
            self.table.add_into(device, slot, values)
        self._later.clear()
        if len(self._groups) > MAX_GROUPS // 2:
            self._groups = {k: g for k, g in self._groups.items() if g.staged}
        for group in self._groups.values():
            wanted = min(group.staged, group.most)
            if wanted > len(group.rows):
                _grow(group, wanted)
            group.staged = 0

    def drop(self) -> None:
        """Forget the staged rows (their pass was an evaluation, not the training step)."""
        for group in self._groups.values():
            group.slots.clear()
        self._later.clear()
        self._busy = False

    def _reduce(self, group: _Group) -> None:
        import torch

        n, slots = len(group.slots), group.slots
        block = group.block[:n]
        try:
            wanted, source, target = self._layout(block.device, slots, group.lean)
            if not wanted:  # a lean step's rows of slots that have only the skipped columns
                return
            computed = _statistics(block, group.mode, wanted)
            values = torch.stack([computed[c] for c in wanted], 1).flatten()
            if source is not None:  # some slot lacks a computed column
                values = values.index_select(0, source)
            self.table.write(block.device, target, values)
        finally:  # a failure loses this block's rows, never wedges the group
            slots.clear()
        self.flushes += 1

    def _layout(
        self, device: Any, slots: list[Slot], lean: bool
    ) -> tuple[tuple[int, ...], Any, Any]:
        """The columns a block computes, and which of its values go to which buffer
        cells: made once per slot order (the same step after step), so a block walks
        no slot in Python and a step makes no host-to-device copy."""
        key = (device, lean, *(s.index for s in slots))
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            wanted = _columns(slots, skip=LEAN_SKIPS if lean else ())
            found = self._layouts[key] = (wanted, *_index(device, slots, wanted))
        return found


def unit_mode(slot: Slot, nonnegative: bool) -> str:
    """How a slot's dead units are counted: its rows share blocks with others alike.

    ``nonnegative``: the module's output is >= 0 or NaN (a ReLU), see
    :func:`~breakpod._monitor.checks.unit_maxima`."""
    if not slot.zeros:
        return ""
    return "pre_relu" if slot.pre_relu else "nonnegative" if nonnegative else "abs"


def _new_group(x: Any, mode: str) -> _Group:
    budget = CPU_BLOCK_BYTES if x.device.type == "cpu" else BLOCK_BYTES
    most = max(1, min(MAX_ROWS, budget // max(1, x.numel() * x.element_size())))
    block = _block(x, min(most, FIRST_ROWS))
    return _Group(block, list(block.unbind()), mode, most)


def _grow(group: _Group, rows: int) -> None:
    """A larger block for ``group`` (at a step's end: it holds no staged row)."""
    try:
        block = _block(group.rows[0], rows)
    except (RuntimeError, MemoryError):  # out of memory: the block it has still serves
        return
    group.block, group.rows = block, list(block.unbind())


def _block(like: Any, rows: int) -> Any:
    """``rows`` rows of ``like``'s shape, dtype and device."""
    import torch

    return lasting(torch.empty, (rows, *like.shape), dtype=like.dtype, device=like.device)


def _columns(slots: list[Slot], skip: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The columns some slot of the block has, in the table's order, but ``skip``."""
    has = [any(column) for column in zip(*(s.columns for s in slots), strict=True)]
    return tuple(column for column, on in enumerate(has) if on and column not in skip)


def _statistics(block: Any, mode: str, wanted: tuple[int, ...]) -> dict[int, Any]:
    """Each wanted column for every row of ``block``, in as few passes over it as may be.

    With the flight recorder's min and max, the non-finite signal is ``min + max``
    (NaN when either is, +Inf or -Inf as a sum would be, NaN for both together), not
    a third pass for ``sum x``; without them it is ``sum x``, as on the direct path.
    Rows of a ReLU's output (``nonnegative``) take their max and the live-unit
    count from one per-unit max; their min is the least per-unit max (>= the
    true min, >= 0: the same ``max |x|`` and non-finite kinds, which is what
    the flight recorder reads of it).
    """
    import torch

    f32, n = torch.float32, len(block)
    flat = block.reshape(n, -1)
    out: dict[int, Any] = {}
    if MEAN_ABS in wanted:
        out[MEAN_ABS] = torch.linalg.vector_norm(flat, 1, dim=1, dtype=f32)
    if NORM in wanted:
        out[NORM] = torch.linalg.vector_norm(flat, 2, dim=1, dtype=f32)
    per_unit = None
    if ZEROS in wanted:  # a dead-unit mode (nonnegative too) is only given to these slots
        dims = tuple(d + 1 for d in checks.batch_dims(block.dim() - 1))
        per_unit = checks.unit_maxima(block, dims, mode == "pre_relu", mode == "nonnegative")
        per_unit = per_unit.reshape(n, -1)
        out[ZEROS] = torch.linalg.vector_norm(per_unit, 0, dim=1, dtype=f32)
    relu_maxima = per_unit if mode == "nonnegative" else None  # None too on a lean step
    if TOTAL in wanted and LOW not in wanted and relu_maxima is None:
        out[TOTAL] = flat.sum(1, dtype=f32)  # no flight recorder: one pass, as direct
    elif TOTAL in wanted or LOW in wanted:
        if relu_maxima is not None:
            low, high = relu_maxima.amin(1), relu_maxima.amax(1)
        elif block.device.type == "cpu":  # the CPU's aminmax over a dim is a slow path
            low, high = flat.amin(1), flat.amax(1)
        else:
            low, high = torch.aminmax(flat, dim=1)
        out[LOW], out[HIGH] = low.to(f32), high.to(f32)
        out[TOTAL] = out[LOW] + out[HIGH]
    return out


def _index(device: Any, slots: list[Slot], wanted: tuple[int, ...]) -> tuple[Any, Any]:
    """``(source, target)``: positions in the block's values and in the table's buffer;
    ``source`` is None when it would take every value in order (the block's slots all
    have every column it computes: no kernel to select them)."""
    import torch

    source, target = [], []
    for row, slot in enumerate(slots):
        for position, column in enumerate(wanted):
            if (cell := slot.cell(column)) >= 0:
                source.append(row * len(wanted) + position)
                target.append(cell)
    every = source == list(range(len(slots) * len(wanted)))
    pair = [None if every else torch.tensor(source), torch.tensor(target)]
    if getattr(device, "type", "cpu") != "cpu":
        pair = [t if t is None else t.pin_memory().to(device, non_blocking=True) for t in pair]
    return pair[0], pair[1]
