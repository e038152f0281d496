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
  torch (a few hundred ms). So small tensors of one shape and dtype are
  stacked, a scratch block's worth at a time, and reduced by one norm over
  the block's rows; large ones take a norm each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

MAX_NUMEL = 1 << 15  # larger tensors take a norm each: their pass outweighs a dispatch
SCRATCH_BYTES = 1 << 18  # a shape's scratch block: rows stacked and reduced together


@dataclasses.dataclass(frozen=True)
class _Part:
    """Tensors reduced together: stacked into ``scratch`` (CPU), or by one foreach."""

    positions: tuple[int, ...]
    scratch: Any = None  # (rows, *shape), shared by the parts of one shape


@dataclasses.dataclass(frozen=True)
class _Group:
    device: Any
    parts: tuple[_Part, ...]
    keys: list[int]  # every part's tensors' keys, in order


class NormPlan:
    """Float32 L2 norms of tensors like ``like`` (position by position), a vector per device."""

    def __init__(self, like: Sequence[Any], keys: Sequence[int] | None = None) -> None:
        self._like = list(like)
        self._keys = list(range(len(self._like)) if keys is None else keys)
        self._groups = _plan(self._like, self._keys)

    def __call__(self, tensors: Sequence[Any]) -> list[tuple[Any, list[int], Any]]:
        """``(device, keys, norms)`` per device: ``norms[k]`` is the norm of the tensor
        whose key is ``keys[k]`` (its position in ``tensors``, unless the plan was given
        keys); a ``None`` (a parameter without a gradient) is left out."""
        import torch

        if self._moved():
            self._groups = _plan(self._like, self._keys)
        with torch.no_grad():  # one guard, not a detach per tensor
            found = [self._group_norms(group, tensors) for group in self._groups]
        return [result for result in found if result is not None]

    def _group_norms(
        self, group: _Group, tensors: Sequence[Any]
    ) -> tuple[Any, list[int], Any] | None:
        import torch

        results = [_reduce(part, tensors) for part in group.parts]
        values = [v for _, v in results if v is not None]
        if not values:
            return None
        if all(got is part.positions for part, (got, _) in zip(group.parts, results, strict=True)):
            keys = group.keys  # nothing missing: no list made
        else:
            keys = [self._keys[i] for got, _ in results for i in got]
        return group.device, keys, torch.cat(values) if len(values) > 1 else values[0]

    def _moved(self) -> bool:
        """Did the parameters change device or dtype since the plan (``model.to``)?"""
        for group in self._groups:
            for part in group.parts:
                like = self._like[part.positions[0]]
                if like.device != group.device or (
                    part.scratch is not None and like.dtype != part.scratch.dtype
                ):
                    return True
        return False


def _plan(like: list[Any], keys: list[int]) -> tuple[_Group, ...]:
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(like):
        by_device.setdefault(t.device, []).append(i)
    groups = []
    for device, positions in by_device.items():
        on_cpu = device.type == "cpu"
        parts = _cpu_parts(like, positions) if on_cpu else (_Part(tuple(positions)),)
        groups.append(_Group(device, parts, [keys[i] for part in parts for i in part.positions]))
    return tuple(groups)


def _cpu_parts(like: list[Any], positions: list[int]) -> tuple[_Part, ...]:
    import torch

    shapes: dict[tuple[Any, ...], list[int]] = {}
    large = []
    for i in positions:
        t = like[i]
        if t.numel() > MAX_NUMEL or t.numel() == 0:
            large.append(i)
        else:
            shapes.setdefault((t.shape, t.dtype), []).append(i)
    parts = [_Part(tuple(large))] if large else []
    for (shape, dtype), same in shapes.items():
        if len(same) == 1:
            parts.append(_Part(tuple(same)))
            continue
        row_bytes = like[same[0]].numel() * like[same[0]].element_size()
        rows = max(1, min(len(same), SCRATCH_BYTES // row_bytes))
        scratch = torch.empty((rows, *shape), dtype=dtype)
        parts += [_Part(tuple(same[s : s + rows]), scratch) for s in range(0, len(same), rows)]
    return tuple(parts)


def _reduce(part: _Part, tensors: Sequence[Any]) -> tuple[Sequence[int], Any]:
    import torch

    chosen = [tensors[i] for i in part.positions]
    if part.scratch is not None:
        block = part.scratch[: len(chosen)]
        try:
            torch.stack(chosen, out=block)
        except (TypeError, RuntimeError, NotImplementedError):  # a missing or sparse gradient
            return _one_by_one(part.positions, chosen)
        return part.positions, _norm(block.flatten(1), dim=1)
    if any(t is None for t in chosen):
        return _one_by_one(part.positions, chosen)
    return part.positions, _norm_each(chosen)


def _one_by_one(positions: Sequence[int], chosen: list[Any]) -> tuple[list[int], Any]:
    keys = [i for i, t in zip(positions, chosen, strict=True) if t is not None]
    present = [t for t in chosen if t is not None]
    return (keys, _norm_each(present)) if present else ([], None)


def _norm_each(tensors: list[Any]) -> Any:
    """Float32 norms, fused where torch can; the tensors torch's fused norm refuses
    (float64 or complex ones, sparse gradients) take a norm each."""
    import torch

    try:
        return torch.stack(torch._foreach_norm(tensors, dtype=torch.float32))
    except (RuntimeError, NotImplementedError):
        return torch.stack([_norm(t) for t in tensors])


def _norm(t: Any, dim: int | None = None) -> Any:
    """``t``'s L2 norm (over ``dim``) as float32, summed in float32 or wider."""
    import torch

    if t.is_sparse:
        t = t.coalesce().values()
    wide = t.element_size() > 4 or t.is_complex()
    return torch.linalg.vector_norm(t, 2, dim=dim, dtype=None if wide else torch.float32).float()
