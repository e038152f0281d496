"""The L2 norms of a model's watched parameters, or of their gradients, every step.

The tensors are the same step after step (a gradient has its parameter's
shape, dtype and device), so how to reduce them is planned once, from the
parameters:

* On a GPU, one ``torch._foreach_norm`` per device: one fused kernel.
* On a CPU ``_foreach_norm`` is a loop of single norms, each a dispatch, and it
  returns one tensor object per input. Hundreds of objects made at once set
  off the garbage collector, in the middle of the step, where the autograd
  graph's own objects are alive: they are promoted, die old, and bring on
  full collections, each a pass over every object of a process that imported
  torch (a few hundred ms). So small tensors of a shape that many of them
  share (an MLP's hundreds of layers) are stacked, a float32 scratch block's
  worth at a time, and reduced by one norm over the block's rows. The others
  (large tensors, and shapes that few share: a CNN's) take one foreach: a
  stack and a norm per part would cost more dispatches than they save.

Whatever the plan did not foresee (a parameter moved alone to another device
after the plan, a sparse gradient, a complex one) falls back to grouping the
tensors by device at the call, as an unplanned norm would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

MAX_NUMEL = 1 << 15  # larger tensors take a norm each: their pass outweighs a dispatch
SCRATCH_BYTES = 1 << 18  # a shape's scratch block: rows stacked and reduced together
STACKED = 16  # a shape with this many small tensors is stacked; fewer join the foreach


@dataclasses.dataclass(frozen=True)
class _Part:
    """Tensors reduced together: stacked into ``scratch`` (CPU), or by one foreach."""

    positions: tuple[int, ...]
    scratch: Any = None  # float32 (rows, *shape), shared by the parts of one shape
    fused: bool = True  # one foreach; else a norm each (tensors the fused norm refuses)


@dataclasses.dataclass(frozen=True)
class _Group:
    device: Any
    parts: tuple[_Part, ...]
    positions: list[int]  # every part's, in order
    keys: list[int]  # their keys


class NormPlan:
    """Float32 L2 norms of tensors like ``like`` (position by position), a vector per device."""

    def __init__(self, like: Sequence[Any], keys: Sequence[int] | None = None) -> None:
        self._like = list(like)
        self._keys = list(range(len(self._like)) if keys is None else keys)
        self._lazy = _lazy(self._like)  # a lazy module's parameters, planned once they exist
        self._groups = _plan(self._like, self._keys)

    def __call__(self, tensors: Sequence[Any]) -> list[tuple[Any, list[int], Any]]:
        """``(device, keys, norms)`` per device: ``norms[k]`` is the norm of the tensor
        whose key is ``keys[k]`` (its position in ``tensors``, unless the plan was given
        keys); a ``None`` (a parameter without a gradient) is left out."""
        import torch

        if self._moved() or (self._lazy and self._lazy != _lazy(self._like)):
            self._lazy = _lazy(self._like)
            self._groups = _plan(self._like, self._keys)
        out = []
        with torch.no_grad():  # one guard, not a detach per tensor
            for group in self._groups:
                try:
                    out += self._planned(group, tensors)
                except (TypeError, RuntimeError, NotImplementedError):  # not as planned
                    out += self._unplanned(group.positions, tensors)
        return out

    def _planned(self, group: _Group, tensors: Sequence[Any]) -> list[tuple[Any, list[int], Any]]:
        import torch

        results = [_reduce(part, tensors) for part in group.parts]
        values = [v for _, v in results if v is not None]
        if not values:
            return []
        if all(got is part.positions for part, (got, _) in zip(group.parts, results, strict=True)):
            keys = group.keys  # nothing missing: no list made
        else:
            keys = [self._keys[i] for got, _ in results for i in got]
        return [(group.device, keys, torch.cat(values) if len(values) > 1 else values[0])]

    def _unplanned(
        self, positions: list[int], tensors: Sequence[Any]
    ) -> list[tuple[Any, list[int], Any]]:
        """The unplanned way: the tensors grouped by device now, a fused norm each group."""
        present = [i for i in positions if tensors[i] is not None]
        return [
            (device, [self._keys[i] for i in got], _norm_each([tensors[i] for i in got]))
            for device, got in _by_device(tensors, present).items()
        ]

    def _moved(self) -> bool:
        """Did the parameters change device or shape since the plan (``model.to``)? One
        tensor a part is looked at; a part that is not as planned falls back in the call."""
        for group in self._groups:
            for part in group.parts:
                like = self._like[part.positions[0]]
                if like.device != group.device or (
                    part.scratch is not None and like.shape != part.scratch.shape[1:]
                ):
                    return True
        return False


def _by_device(tensors: Sequence[Any], positions: Sequence[int]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i in positions:
        groups.setdefault(tensors[i].device, []).append(i)
    return groups


def _lazy(like: list[Any]) -> list[int]:
    """Positions of parameters not made yet (a lazy module's, before its first call)."""
    from torch.nn.parameter import is_lazy

    return [i for i, t in enumerate(like) if is_lazy(t)]


def _plan(like: list[Any], keys: list[int]) -> tuple[_Group, ...]:
    groups = []
    lazy = set(_lazy(like))
    ready = [i for i in range(len(like)) if i not in lazy]
    for device, on_device in _by_device(like, ready).items():
        narrow = tuple(i for i in on_device if _narrow(like[i]))
        wide = tuple(i for i in on_device if not _narrow(like[i]))
        parts = _cpu_parts(like, narrow) if device.type == "cpu" else (_Part(narrow),)
        parts = tuple(p for p in (*parts, _Part(wide, fused=False)) if p.positions)
        positions = [i for part in parts for i in part.positions]
        groups.append(_Group(device, parts, positions, [keys[i] for i in positions]))
    return tuple(groups)


def _narrow(t: Any) -> bool:
    """Real and float32 or narrower: what the fused float32 norm takes. Wider tensors
    take a norm each, summed in float64 (rounded first, their squares would overflow
    float32 from 1.8e19)."""
    return bool(t.is_floating_point() and t.element_size() <= 4)


def _cpu_parts(like: list[Any], positions: tuple[int, ...]) -> tuple[_Part, ...]:
    """Many small tensors of one shape share float32 scratch blocks; the others (large
    ones, and shapes with few tensors) take one foreach."""
    import torch

    shapes: dict[Any, list[int]] = {}
    for i in positions:
        if 0 < like[i].numel() <= MAX_NUMEL:
            shapes.setdefault(like[i].shape, []).append(i)
    stacked = {shape: same for shape, same in shapes.items() if len(same) >= STACKED}
    others = [i for i in positions if like[i].shape not in stacked]  # a shape: one numel
    parts = [_Part(tuple(others))] if others else []
    for shape, same in stacked.items():
        rows = max(1, min(len(same), SCRATCH_BYTES // (4 * like[same[0]].numel())))
        scratch = torch.empty((rows, *shape), dtype=torch.float32)
        parts += [_Part(tuple(same[s : s + rows]), scratch) for s in range(0, len(same), rows)]
    return tuple(parts)


def _reduce(part: _Part, tensors: Sequence[Any]) -> tuple[Sequence[int], Any]:
    import torch

    chosen = [tensors[i] for i in part.positions]
    norms = _norm_each if part.fused else _one_by_one
    if any(t is None for t in chosen):
        keys = [i for i, t in zip(part.positions, chosen, strict=True) if t is not None]
        present = [t for t in chosen if t is not None]
        return (keys, norms(present)) if present else ([], None)
    if part.scratch is None:
        return part.positions, norms(chosen)
    block = part.scratch[: len(chosen)]
    torch.stack(chosen, out=block)  # a sparse gradient raises: the call falls back
    return part.positions, torch.linalg.vector_norm(block.reshape(len(chosen), -1), 2, dim=1)


def _norm_each(tensors: list[Any]) -> Any:
    """Float32 norms of tensors on one device, fused where torch can; the tensors torch's
    fused norm refuses at the call (sparse gradients) take a norm each."""
    import torch

    try:
        return torch.stack(torch._foreach_norm(tensors, dtype=torch.float32))
    except (RuntimeError, NotImplementedError):  # a sparse gradient, or one moved apart
        return _one_by_one(tensors)


def _one_by_one(tensors: list[Any]) -> Any:
    import torch

    return torch.stack([_norm(t) for t in tensors])


def _norm(t: Any) -> Any:
    """``t``'s L2 norm as float32, summed in float32 or wider."""
    import torch

    if t.is_sparse:
        t = t.coalesce().values()
    wide = t.element_size() > 4 or t.is_complex()
    return torch.linalg.vector_norm(t, 2, dtype=None if wide else torch.float32).float()
