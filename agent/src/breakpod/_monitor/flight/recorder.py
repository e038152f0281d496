"""The flight recorder: the last K steps of every watched module, kept on the device.

Each watched output (and input gradient) also gets three columns in the slot
table's buffer: ``|x|_2``, ``min`` and ``max`` (two kernels, see
:func:`~breakpod._monitor.checks.write_flight`). Each step's end copies that
buffer into one row of a ring per device and the loss into a ring beside it
(one kernel each, no allocation, no host read); the host notes which slots ran,
their sizes, the step number and its time. Every parameter gradient's norm, as
the step computed it (one vector per device, in both tiers: in the sentinel tier
it is the row a module's would be), goes into a third ring (one copy per device).
Only a dump reads the rings (one copy per device): with every ``anomaly`` and
``stall`` event, the ``flight`` pdb command, and ``breakpod flight SESSION``.

A dump reads as a table (:mod:`~breakpod._monitor.flight.table`): per module,
the first kept step where its values went non-finite or out of range, with its
RMS over the steps before. ``BREAKPOD_FLIGHT_STEPS`` sets K (default 64); 0
turns the recorder off (no columns, no ring, no hook work).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from breakpod import protocol
from breakpod._core import events
from breakpod._core.announce import announce
from breakpod._core.config import parse_int
from breakpod._core.errors import ConfigError
from breakpod._monitor.detect import NORM, Slot
from breakpod._monitor.flight.table import Flight, Series
from breakpod._monitor.stats import SlotTable, StepRecord, copy_events, landed, lasting, to_host

FLIGHT_ENV = "BREAKPOD_FLIGHT_STEPS"
FIELD = protocol.FLIGHT_FIELD
DEFAULT_STEPS = 64
MAX_STEPS = 4096
DUMP_WAIT = 1.0  # a stalled device may never finish the copy: a dump gives up then
LOSS = "<loss>"  # the loss's row in the table
BATCH = "<batch>"  # the model's input, checked at its forward
# a step's order: forwards, the loss, backwards, the parameter gradients' norms
LOSS_AT, BACKWARDS_AT, GRADS_AT = 10**6, 2 * 10**6, 3 * 10**6
GRAD = "grad"  # the phase of a parameter gradient's series


def flight_steps(environ: Mapping[str, str] | None = None) -> int:
    """``BREAKPOD_FLIGHT_STEPS``: steps kept (0 = off); a bad value is said and ignored."""
    raw = (os.environ if environ is None else environ).get(FLIGHT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_STEPS
    try:
        steps = parse_int(FLIGHT_ENV, raw.strip())
        if steps < 0:
            raise ConfigError(f"{FLIGHT_ENV}={raw!r} is negative")
    except ConfigError as e:
        announce(f"{e}: expected a step count (0 = off); keeping {DEFAULT_STEPS}")
        return DEFAULT_STEPS
    if steps > MAX_STEPS:  # the ring lives in device memory: steps x columns x 4 bytes
        announce(f"{FLIGHT_ENV}={steps} keeps too many steps in device memory; keeping {MAX_STEPS}")
        return MAX_STEPS
    return steps


@dataclasses.dataclass
class _Row:
    """The host's half of one ring row."""

    step: int
    seconds: float  # since the previous step's end (NaN for the first)
    ran: dict[Any, dict[int, int]]  # device -> {slot index: numel}
    loss_device: Any = None
    grads: dict[Any, Sequence[int]] | None = None  # device -> the parameters its ring row holds


class FlightRecorder:
    """Device rings of the last ``size`` steps of a monitor's slot table."""

    def __init__(
        self, slots: Sequence[Slot], size: int, params: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self.slots = list(slots)
        self.size = size
        self.params = list(params)  # (name, parameter) by key, as the norms' keys say
        self._rings: dict[Any, Any] = {}
        self._losses: dict[Any, Any] = {}
        self._grads: dict[Any, Any] = {}
        self._rows: list[_Row | None] = [None] * size
        self._count = 0  # steps recorded
        self._last_end: float | None = None
        # the previous row's slots: a row of a model of 800 modules holds a dict of
        # 1,600 entries, and 64 rows of the same dict cost megabytes of host memory
        self._last_ran: dict[Any, dict[int, int]] = {}
        self._fields: tuple[int, dict[str, Any]] | None = None  # (steps recorded, fields)
        RECORDERS.add(self)
        events.add_enricher((protocol.ANOMALY, protocol.STALL), event_fields)

    def record(self, record: StepRecord, table: SlotTable) -> None:
        """The step's end: its buffers and loss into the ring (one copy per device)."""
        pos = self._count % self.size
        for device in record.ran:
            self._ring(self._rings, device, table.width)[pos].copy_(table.buffer(device))
        now = time.perf_counter()
        seconds = math.nan if self._last_end is None else now - self._last_end
        self._last_end = now
        ran = record.ran
        if _same_run(ran, self._last_ran):  # the same slots as the step before: share it
            ran = self._last_ran
        grads = self._record_grads(record, pos)
        self._rows[pos], self._last_ran = _Row(record.step, seconds, ran, grads=grads), ran
        self._count += 1
        loss = next((e.vec for e in record.entries if e.kind == "loss"), None)
        if loss is not None:
            self.record_loss(loss)

    def record_loss(self, loss: Any) -> None:
        """The loss of the last recorded step (also when it arrives after the step ended)."""
        row = self._rows[(self._count - 1) % self.size] if self._count else None
        if row is None:
            return
        self._ring(self._losses, loss.device, 0)[(self._count - 1) % self.size].copy_(loss[0])
        row.loss_device = loss.device

    def _record_grads(self, record: StepRecord, pos: int) -> dict[Any, Sequence[int]] | None:
        """The step's gradient norms (a vector per device) into their ring rows."""
        grads = [e for e in record.entries if e.kind == "grads" and hasattr(e.vec, "numel")]
        if not grads or not self.params:
            return None
        kept: dict[Any, Any] = {}
        for entry in grads:
            ring = self._ring(self._grads, entry.vec.device, len(self.params))
            ring[pos, : entry.vec.numel()].copy_(entry.vec)
            kept[entry.vec.device] = entry.keys  # the plan's list, shared step to step
        return kept

    def _ring(self, rings: dict[Any, Any], device: Any, width: int) -> Any:
        ring = rings.get(device)
        if ring is None:
            import torch

            shape = (self.size, width) if width else (self.size,)
            ring = rings[device] = lasting(torch.full, shape, math.nan, device=device)
        return ring

    def dump(self, wait: float = DUMP_WAIT) -> Flight | None:
        """Read the rings (one copy per device); None when a device did not answer."""
        rings = {("slots", d): r for d, r in self._rings.items()}
        rings.update({("loss", d): r for d, r in self._losses.items()})
        rings.update({("grads", d): r for d, r in self._grads.items()})
        copies = {key: to_host(ring) for key, ring in rings.items()}
        marks = copy_events({key[1]: copy for key, copy in copies.items()})
        deadline = time.monotonic() + wait
        while not landed(marks, wait=False):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self._read({key: copy.tolist() for key, copy in copies.items()})

    def _read(self, host: dict[tuple[str, Any], Any]) -> Flight:
        order = [(self._count - n) % self.size for n in range(min(self._count, self.size), 0, -1)]
        rows = [(pos, row) for pos in order if (row := self._rows[pos]) is not None]
        series: dict[int, Series] = {}
        grads: dict[int, Series] = {}
        sizes = [_numel(param) for _, param in self.params]  # for an RMS: norm / sqrt(size)
        loss = Series(LOSS, "loss")
        for pos, row in rows:
            position = 0  # in the step's execution: forwards (the loss after) and backwards
            for device, ran in row.ran.items():
                values = host[("slots", device)][pos]
                for index, numel in ran.items():
                    slot, position = self.slots[index], position + 1
                    name = BATCH if slot.phase == "input" else slot.module
                    found = series.setdefault(index, Series(name, slot.phase))
                    when = position + (BACKWARDS_AT if slot.phase == "backward" else 0)
                    found.add(row.step, when, *_stats(values, slot, numel))
            if row.loss_device is not None:
                value = host[("loss", row.loss_device)][pos]
                loss.add(row.step, LOSS_AT, value, abs(value), _kind(value, value, value))
            for device, keys in (row.grads or {}).items():
                self._add_grads(grads, sizes, row.step, keys, host[("grads", device)][pos])
        seconds = [row.seconds for _, row in rows if not math.isnan(row.seconds)]
        return Flight(
            steps=[row.step for _, row in rows],
            step_seconds=seconds,
            series=([loss] if loss.steps else []) + [*series.values(), *grads.values()],
        )

    def _add_grads(
        self,
        grads: dict[int, Series],
        sizes: Sequence[int],
        step: int,
        keys: Sequence[int],
        norms: Sequence[float],
    ) -> None:
        """One row's gradient norms: per parameter, its RMS (norm / sqrt(size)) and norm."""
        for key, norm in zip(keys, norms, strict=False):
            if key >= len(self.params):
                continue  # a parameter planned after the recorder (a lazy module's)
            found = grads.setdefault(key, Series(self.params[key][0], GRAD))
            kind = "nan" if math.isnan(norm) else "inf" if math.isinf(norm) else ""
            found.add(step, GRADS_AT + key, norm / math.sqrt(sizes[key]), norm, kind)

    def fields(self) -> dict[str, Any]:
        """:meth:`dump` as an event carries it; the events of one step (anomalies of
        several modules) share one dump."""
        if self._fields is None or self._fields[0] != self._count:
            flight = self.dump()
            unavailable = f"the device did not finish the copy within {DUMP_WAIT:g}s"
            self._fields = (
                self._count,
                {"unavailable": unavailable} if flight is None else flight.fields(),
            )
        return dict(self._fields[1])

    def close(self) -> None:
        RECORDERS.discard(self)


RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


def _same_run(ran: dict[Any, dict[int, int]], last: dict[Any, dict[int, int]]) -> bool:
    """The same slots, sizes and execution order (dict equality ignores the order, which
    is what a row's positions are read from)."""
    if ran != last or list(ran) != list(last):
        return False
    return all(list(ran[device]) == list(last[device]) for device in ran)


def _numel(param: Any) -> int:
    """At least 1; a lazy module's parameter counts 1 until it is materialized."""
    try:
        return max(int(param.numel()), 1)
    except ValueError:  # torch's UninitializedParameter refuses numel()
        return 1


def _stats(values: Sequence[float], slot: Slot, numel: int) -> tuple[float, float, str]:
    """``(rms, max |x|, non-finite kind or "")`` of one slot's columns in one row."""
    at = slot.cell(NORM)
    norm, low, high = values[at : at + 3]
    rms = norm / math.sqrt(max(numel, 1))
    return rms, max(abs(low), abs(high)), _kind(norm, low, high)


def _kind(norm: float, low: float, high: float) -> str:
    if math.isnan(norm) or math.isnan(low) or math.isnan(high):
        return "nan"
    if high == math.inf:
        return "+inf"
    if low == -math.inf:
        return "-inf"
    if norm == math.inf:
        return "overflow"  # finite values whose L2 norm exceeds float32
    return ""


def dump_fields() -> dict[str, Any] | None:
    """The most recently active recorder's dump, as events carry it; None without one."""
    recorders = sorted(RECORDERS, key=lambda r: r._last_end or 0.0)
    return recorders[-1].fields() if recorders else None


def event_fields() -> dict[str, Any]:
    """The enricher of ``anomaly`` and ``stall`` events: ``{"flight": dump}``."""
    fields = dump_fields()
    return {} if fields is None else {FIELD: fields}
