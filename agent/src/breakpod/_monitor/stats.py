"""The per-step stats buffer: small device tensors in, host floats out.

Module hooks write their statistics into :class:`SlotTable`'s preallocated
per-device buffer (a column per statistic, fixed at install, one kernel per
statistic, nothing allocated) and note on the host which slots ran; the
step's end snapshots that buffer (one copy per device). Gradient norms, the
loss and state checks append :class:`Entry` objects holding small vectors.
At a read, :func:`pack` stacks every pending step's results into one tensor
per device (one or two kernels), :func:`to_host` starts the copy
(non-blocking, into a reused pinned buffer on CUDA, :class:`HostBuffers`),
:func:`copy_event` marks when it lands, and :func:`decode` turns the floats back into one
:class:`~breakpod._monitor.detect.StepData` per step. There
:meth:`SlotTable.expand` judges every slot at once on the host tensor
(non-finite, mean |x| and zero fraction against per-slot limit vectors) and
builds a :class:`~breakpod._monitor.detect.Sample` only for the few that are
flagged or mid-streak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

from breakpod._monitor.detect import HIGH, LOW, MEAN_ABS, TOTAL, ZEROS, Sample, Slot, StepData


@dataclasses.dataclass
class Entry:
    """One small stats tensor produced during a step, and what it describes."""

    kind: str  # slots | grads | loss | params | batchnorm | gate
    vec: Any
    slot: Slot | None = None
    numel: int = 0
    keys: Sequence[Any] | dict[int, int] = ()  # a dict for slots: {slot index: numel}
    tensor: Any = None
    units: dict[int, int] | None = None  # slots: {slot index: units}, in the order of keys


@dataclasses.dataclass
class StepRecord:
    """What one training step produced, until it is read."""

    step: int
    entries: list[Entry] = dataclasses.field(default_factory=list)
    grads_done: bool = False
    partial: bool = False  # a loss that arrived after the optimizer ended the step
    eval_only: bool = False  # its stats so far come from no_grad passes (evaluation)
    stats: bool = True  # activation statistics (mean |x|, dead units) computed this step
    # device -> {slot index: numel}, in execution order: the slots whose hooks ran
    ran: dict[Any, dict[int, int]] = dataclasses.field(default_factory=dict)
    # device -> {slot index: units}, for the slots with a dead_units column only
    units: dict[Any, dict[int, int]] = dataclasses.field(default_factory=dict)
    kept: dict[int, Any] = dataclasses.field(default_factory=dict)  # for break/snapshot rules
    read_now: bool = False  # the sentinel saw a non-finite gradient: read at its end
    averaged: bool = False  # a training forward ran inside DDP's (detailed tier only)


class SlotTable:
    """Every watched tensor stream's columns in one per-device buffer, and their judgement.

    Built once at install: the columns, the limit vectors and (lazily, per
    device) the buffer with its 0-d views, so a hook only writes and the
    host never walks the slots that are fine.
    """

    def __init__(self, slots: Sequence[Slot]) -> None:
        import torch

        self.slots = list(slots)
        self.width = sum(s.width for s in slots)
        self._buffers: dict[Any, Any] = {}
        # 0-d views of each buffer for the direct path, made on its first use: one Python
        # tensor object per column, megabytes on a model of hundreds of modules
        self._cells: dict[Any, list[Any]] = {}
        self._by_module: dict[str, list[int]] = {}
        for s in slots:
            self._by_module.setdefault(s.module, []).append(s.index)
        n, nan = len(slots), math.nan
        self._total, self._abs, self._zeros = (
            torch.tensor([s.cell(column) for s in slots] or [0])
            for column in (TOTAL, MEAN_ABS, ZEROS)
        )
        self._abs_limit = torch.tensor([s.abs_limit for s in slots] or [nan], dtype=torch.float64)
        self._zero_limit = torch.tensor([s.zero_limit for s in slots] or [nan], dtype=torch.float64)
        self._any = n > 0

    def cells(self, device: Any) -> list[Any]:
        """The 0-d views the direct path writes into on ``device``."""
        found = self._cells.get(device)
        if found is None:
            found = self._cells[device] = list(self.buffer(device).unbind())
        return found

    def write(self, device: Any, cells: Any, values: Any) -> None:
        """``values`` into the buffer's ``cells`` (a staged block's statistics: one kernel)."""
        self.buffer(device).index_copy_(0, cells, values)

    def add_into(self, device: Any, slot: Slot, scratch: Any) -> None:
        """A second call of a module in one step: its statistics add to the first's
        (the flight columns combine as norms and extremes do)."""
        import torch

        buffer = self._buffers[device]
        end = slot.base + slot.rule_width
        buffer[slot.base : end].add_(scratch[: slot.rule_width])
        if slot.flight:
            norm, low, high = buffer[end : end + 3].unbind()
            torch.hypot(norm, scratch[-3], out=norm)
            torch.minimum(low, scratch[-2], out=low)
            torch.maximum(high, scratch[-1], out=high)

    def buffer(self, device: Any) -> Any:
        """This step's buffer on ``device`` (made on first use)."""
        found = self._buffers.get(device)
        if found is None:
            import torch

            found = self._buffers[device] = lasting(torch.zeros, self.width, device=device)
        return found

    def snapshot(self, record: StepRecord) -> None:
        """The step's end: one copy of each device's buffer that some hook wrote."""
        for device, ran in record.ran.items():
            buffer = self._buffers[device].clone()
            units = record.units[device]
            record.entries.append(Entry("slots", buffer, keys=ran, tensor=record.kept, units=units))

    def expand(self, data: StepData, hot: Collection[str]) -> None:
        """Samples for the slots worth a look: flagged by a vector test, or mid-streak."""
        for ran, values, kept, units in data.slot_groups:
            order = list(ran)
            for pos, row, numel, n_units in self._flagged(ran, values, hot, units, data.stats):
                slot = self.slots[order[pos]]
                sample = Sample(slot, row, numel, kept.get(slot.index), n_units)
                if slot.flight and sample.nonfinite:  # min and max tell an overflow apart
                    low, high = values[slot.cell(LOW)], values[slot.cell(HIGH)]
                    sample.extremes = (float(low), float(high))
                if slot.phase == "input":  # the batch: named after the first module that ran
                    sample.consumer = self._first_module(order[pos + 1 :])
                (data.backward if slot.phase == "backward" else data.forward).append(sample)
        data.slot_groups = []

    def _first_module(self, after: Sequence[int]) -> str:
        return next((self.slots[i].module for i in after if self.slots[i].phase == "forward"), "")

    def _flagged(
        self,
        ran: dict[int, int],
        values: Any,
        hot: Collection[str],
        units: dict[int, int],
        stats: bool,
    ) -> list[tuple[int, list[float], int, int]]:
        """``(position in ran, values, numel, units)`` of each slot worth a look; without
        ``stats`` (a step that skipped them) only the non-finite signal is judged."""
        import torch

        if not ran or not self._any:
            return []
        index = torch.tensor(list(ran), dtype=torch.long)
        numel = torch.tensor(list(ran.values()), dtype=torch.float64)
        unit = torch.tensor([units.get(i, 0) for i in ran], dtype=torch.float64)
        vals = values.double()
        total, absc, zeros = self._total[index], self._abs[index], self._zeros[index]
        flag = (total >= 0) & ~torch.isfinite(vals[total.clamp(min=0)])
        dead = unit - vals[zeros.clamp(min=0)]  # the column holds the count of live units
        if stats:
            mean_abs = vals[absc.clamp(min=0)] / numel.clamp(min=1)
            flag |= (absc >= 0) & (mean_abs > self._abs_limit[index])
            flag |= (zeros >= 0) & (dead / unit.clamp(min=1) >= self._zero_limit[index])
        picked = set(flag.nonzero().flatten().tolist())
        if hot:
            position = {k: i for i, k in enumerate(ran)}
            for module in hot:
                picked.update(position[i] for i in self._by_module.get(module, ()) if i in position)
        rows = []
        for pos in sorted(picked):
            slot = self.slots[int(index[pos])]
            row = vals[slot.base : slot.base + slot.rule_width].tolist()
            if slot.zeros:
                row[-1] = float(dead[pos])
            rows.append((pos, row, int(numel[pos]), int(unit[pos])))
        return rows


def lasting(make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``make(*args, **kwargs)``: a tensor the monitor writes step after step, made as a
    normal tensor even when its first use comes inside ``torch.inference_mode()`` (an
    inference tensor could never be written again outside it)."""
    import torch

    with torch.inference_mode(False):
        return make(*args, **kwargs)


def by_device(items: Sequence[Any], tensor_of: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    groups: dict[Any, list[Any]] = {}
    for item in items:
        groups.setdefault(tensor_of(item).device, []).append(item)
    return groups


def pack(entries: list[Entry]) -> dict[Any, Any]:
    """Stack many steps' stats into one tensor per device (one or two kernels each).

    Each entry's ``vec`` becomes ``(device, offset, length)`` into that tensor.
    """
    import torch

    packed = {}
    for device, group in by_device(entries, first_tensor).items():
        scalars = [e for e in group if isinstance(e.vec, tuple)]
        vectors = [e for e in group if not isinstance(e.vec, tuple)]
        parts = [torch.stack([t for e in scalars for t in e.vec])] if scalars else []
        parts += [e.vec for e in vectors]
        packed[device] = torch.cat(parts) if len(parts) > 1 else parts[0]
        offset = 0
        for e in scalars + vectors:
            n = len(e.vec) if isinstance(e.vec, tuple) else e.vec.numel()
            e.vec = (device, offset, n)
            offset += n
    return packed


def first_tensor(entry: Entry) -> Any:
    return entry.vec[0] if isinstance(entry.vec, tuple) else entry.vec


def to_host(tensor: Any, buffers: HostBuffers | None = None) -> Any:
    """Start the copy to the host: non-blocking into pinned memory on CUDA.

    With ``buffers`` the copy lands in a reused pinned buffer (give it back with
    :meth:`HostBuffers.give_back` once the copy landed and was read); without,
    in a fresh one. Other accelerators (MPS, XPU) get a plain blocking copy; it
    runs only at a read, at the step boundary, never in a hook.
    """
    import torch

    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    if buffers is None:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    else:
        host = buffers.take(tensor.device, tensor.numel(), tensor.dtype).view(tensor.shape)
    return host.copy_(tensor, non_blocking=True)  # on the source device's current stream


class HostBuffers:
    """Pinned host buffers for the reads' copies, reused per device.

    A fresh pinned block per read made host memory grow with ``check_every``
    (many small blocks held until evaluated) and costs an allocation each read.
    A buffer is lent by :meth:`take` and comes back through :meth:`give_back`
    only once its copy has landed and been read, so a copy never lands in
    memory the host is still reading; reads in flight at once hold one each.
    """

    def __init__(self, *, pinned: bool = True) -> None:
        self.pinned = pinned
        self.allocated = 0  # buffers made so far (a test reads it)
        self._free: dict[Any, list[Any]] = {}
        self._lent: dict[int, tuple[Any, Any]] = {}  # data_ptr -> (device, buffer)

    def take(self, device: Any, numel: int, dtype: Any) -> Any:
        """A 1-d host buffer's first ``numel`` values, for a copy from ``device``."""
        import torch

        free = self._free.setdefault(device, [])
        fits = [b for b in free if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buffer = min(fits, key=lambda b: b.numel())
            free.remove(buffer)
        else:  # grow: a power of two, so a slowly growing read reallocates rarely
            free[:] = [b for b in free if b.dtype != dtype]  # smaller ones are no use now
            size = 1 << max(0, numel - 1).bit_length()
            buffer = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self.allocated += 1
        self._lent[buffer.data_ptr()] = (device, buffer)
        return buffer[:numel]

    def give_back(self, host: Any) -> None:
        """``host`` (what :func:`to_host` returned) may be reused: its copy landed, was read."""
        found = self._lent.pop(host.data_ptr(), None)
        if found is not None:
            self._free.setdefault(found[0], []).append(found[1])


def copy_events(copies: dict[Any, Any]) -> list[Any]:
    """One CUDA event per device, recorded after that device's copy; none off CUDA.

    An event marks one device's stream only: with several GPUs in a process,
    one event on the current device could report done while another copy runs.
    """
    import torch

    events = []
    for device in copies:
        if getattr(device, "type", "") == "cuda":
            with torch.cuda.device(device):
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            events.append(event)
    return events


def landed(events: list[Any], *, wait: bool) -> bool:
    """Have all the copies landed? With ``wait``, block until they have."""
    if wait:
        for event in events:
            event.synchronize()
        return True
    return all(event.query() for event in events)


def decode(step: StepRecord, values: dict[Any, list[float]], hosts: dict[Any, Any]) -> StepData:
    """Split the host copy back into what each of the step's entries described.

    ``values`` are the host copies as floats, ``hosts`` the same as tensors
    (the slot columns are judged there, as vectors).
    """
    data = StepData(step.step, partial=step.partial, stats=step.stats, averaged=step.averaged)
    for e in step.entries:
        device, offset, n = e.vec
        if e.kind == "slots":
            columns = hosts[device][offset : offset + n]
            data.slot_groups.append((e.keys, columns, e.tensor, e.units or {}))
        elif e.kind == "grads":  # the baselines judge them as a vector: no list rebuilt
            data.grad_vectors.append((e.keys, hosts[device][offset : offset + n]))
            _place(data, e, values[device][offset : offset + n])
        else:
            _place(data, e, values[device][offset : offset + n])
    return data


def _place(data: StepData, e: Entry, chunk: list[float]) -> None:
    if e.kind == "grads":
        data.grads.update(zip(e.keys, chunk, strict=True))
    elif e.kind == "params":
        data.params = {**(data.params or {}), **dict(zip(e.keys, chunk, strict=True))}
    elif e.kind == "batchnorm":
        rows = {k: chunk[4 * i : 4 * i + 4] for i, k in enumerate(e.keys)}
        data.batchnorm = {**(data.batchnorm or {}), **rows}
    elif e.kind == "gate":
        data.gate = {str(name): flag for name, flag in zip(e.keys, chunk, strict=True)}
    else:
        data.loss, data.loss_tensor = chunk[0], e.tensor
