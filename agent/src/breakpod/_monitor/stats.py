"""The per-step stats buffer: small device tensors in, host floats out.

Hooks append :class:`Entry` objects holding 0-d results (or a small vector)
on the tensor's device. At a read, :func:`pack` stacks every pending step's
results into one tensor per device (one or two kernels), :func:`to_host`
starts the copy (non-blocking, into pinned memory on CUDA), :func:`copy_event`
marks when it lands, and :func:`decode` turns the floats back into one
:class:`~breakpod._monitor.detect.StepData` per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from breakpod._monitor.detect import Sample, Slot, StepData


@dataclasses.dataclass
class Entry:
    """One small stats tensor produced during a step, and what it describes."""

    kind: str  # forward | backward | grads | loss | params | batchnorm
    vec: Any
    slot: Slot | None = None
    numel: int = 0
    keys: Sequence[Any] = ()
    tensor: Any = None


@dataclasses.dataclass
class StepRecord:
    """What one training step produced, until it is read."""

    step: int
    entries: list[Entry] = dataclasses.field(default_factory=list)
    grads_done: bool = False
    partial: bool = False  # a loss that arrived after the optimizer ended the step


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


def to_host(tensor: Any) -> Any:
    """Start the copy to the host: non-blocking into pinned memory on CUDA.

    Other accelerators (MPS, XPU) get a plain blocking copy; it runs only at
    a read, at the step boundary, never in a hook.
    """
    import torch

    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)  # on the source device's current stream


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


def decode(step: StepRecord, values: dict[Any, list[float]]) -> StepData:
    """Split the host copy back into what each of the step's entries described."""
    data = StepData(step.step, partial=step.partial)
    for e in step.entries:
        device, offset, n = e.vec
        _place(data, e, values[device][offset : offset + n])
    return data


def _place(data: StepData, e: Entry, chunk: list[float]) -> None:
    if e.kind in ("forward", "backward"):
        assert e.slot is not None
        getattr(data, e.kind).append(Sample(e.slot, chunk, e.numel, e.tensor))
    elif e.kind == "grads":
        data.grads.update(zip(e.keys, chunk, strict=True))
    elif e.kind == "params":
        data.params = {**(data.params or {}), **dict(zip(e.keys, chunk, strict=True))}
    elif e.kind == "batchnorm":
        rows = {k: chunk[4 * i : 4 * i + 4] for i, k in enumerate(e.keys)}
        data.batchnorm = {**(data.batchnorm or {}), **rows}
    else:
        data.loss, data.loss_tensor = chunk[0], e.tensor
