"""On-device reductions and host-side shape contracts.

Everything here that touches tensor *values* writes or returns a small
tensor on the tensor's own device and never reads it on the host: no ``.item()``,
``bool(tensor)``, ``.cpu()`` or ``.tolist()``. The monitor concatenates these
small tensors and reads them every ``check_every`` steps.

The reductions are chosen for cost (measured; on CPU the slow paths are
easy to hit): a plain ``sum`` is the cheapest full pass torch has (2-3x
cheaper than ``aminmax``, far cheaper than ``isnan(x).any()``) and is
non-finite exactly when the tensor holds a NaN or an Inf (or, for float32,
values near 1e38 whose sum overflows: an anomaly too). NaN vs +Inf vs -Inf
is read from the sum's value; exact counts are taken later from kept
tensors. ``sum |x|`` (the L1 norm, one pass) and the count of live units
(two kernels: a per-unit max over the batch dims, then the count of its
non-zeros) run only where a rule needs them.
Each statistic is written with ``out=`` into a 0-d view of the monitor's
per-step buffer: one kernel, no allocation, and no stacking at the step's
end (the buffer is the stack).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ANY = ("*", "_", "?", "")
# Names that stand for the batch: a last, smaller batch is no anomaly, so they do not carry.
BATCH_NAMES = ("B", "N")
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def write_stats(
    x: torch.Tensor,
    cells: Sequence[torch.Tensor],
    base: int,
    total: bool = True,
    mean_abs: bool = False,
    zeros: bool = False,
    pre_relu: bool = False,
    flight: bool = False,
    *,
    nonnegative: bool = False,
    stats: bool = True,
) -> None:
    """Write ``[non-finite signal, sum |x|, live units, |x|_2, min, max]`` (those asked
    for) into ``cells[base:]`` on ``x``'s device.

    The non-finite signal is ``sum x``, or, with the flight recorder's columns,
    ``min + max`` (NaN, +Inf and -Inf as a sum shows them, and no pass of its own).
    ``nonnegative``: ``x`` cannot hold a negative value (a ReLU's output); its
    per-unit maxima then also give its max (see :func:`unit_maxima`).

    ``stats=False``: a step that skips the activation statistics (``check_every``):
    ``sum |x|`` and the live units are not computed, their cells keep their place.

    ``cells`` are 0-d views of the monitor's per-step buffer, so each statistic
    is one kernel writing into preallocated memory (no result allocated per
    statistic, none stacked later). ``x`` must be detached: ``out=`` refuses
    tensors that require grad.
    """
    import torch

    i = base
    if total and not flight:
        torch.sum(x, dim=None, dtype=torch.float32, out=cells[i])
    i += int(total)
    if mean_abs:
        if stats:
            torch.linalg.vector_norm(x, 1, dtype=torch.float32, out=cells[i])
        i += 1
    maxima = None
    if zeros:
        if stats:
            maxima = unit_maxima(x, batch_dims(x.dim()), pre_relu, nonnegative)
            torch.linalg.vector_norm(maxima, 0, dtype=torch.float32, out=cells[i])
        i += 1
    if flight:
        write_flight(x, cells, i, maxima if nonnegative and not pre_relu else None)
        if total:
            torch.add(cells[i + 1], cells[i + 2], out=cells[base])


def write_flight(
    x: torch.Tensor, cells: Sequence[torch.Tensor], i: int, maxima: torch.Tensor | None = None
) -> None:
    """The flight recorder's ``|x|_2, min, max``: two kernels (NaN and Inf propagate).

    ``maxima``: a ReLU output's per-unit maxima (>= 0 or NaN), whose least and
    greatest stand for its min and max (the same ``max |x|`` and non-finite
    kinds): a tiny reduction, not a second pass over ``x``. ``aminmax`` writes
    into float32 cells only from float32 input; other dtypes (bf16, fp16) take
    two small copies. (A per-step non-finite *count* would cost ``isfinite``
    plus a boolean sum, 30x a plain sum on CPU: the kind is read from these
    values instead, and the park counts exactly.) The ``|x|_2`` reads every value:
    estimating it from a sample of a large tensor took more ops, and in a training
    step, where the tensor was just written and is in cache, each op's dispatch
    cost more than the memory it saved.
    """
    import torch

    torch.linalg.vector_norm(x, 2, dtype=torch.float32, out=cells[i])
    source = x if maxima is None else maxima
    if source.dtype == torch.float32:
        torch.aminmax(source, out=(cells[i + 1], cells[i + 2]))
    else:
        low, high = torch.aminmax(source)
        cells[i + 1].copy_(low)
        cells[i + 2].copy_(high)


def unit_count(shape: Sequence[int]) -> int:
    """How many units a tensor of ``shape`` has (see :func:`batch_dims`)."""
    if len(shape) <= 1:
        return int(shape[0]) if shape else 1
    return int(shape[-1] if len(shape) == 3 else shape[1])


def batch_dims(ndim: int) -> tuple[int, ...]:
    """The dims a unit spans: all but the features (2-d), channels (4-d, 5-d: N,C,H,W)
    or the last dim (3-d, taken as B,T,D); a 1-d tensor is one value per unit."""
    if ndim <= 1:
        return ()
    if ndim == 3:
        return (0, 1)
    return tuple(d for d in range(ndim) if d != 1)


def unit_maxima(
    x: torch.Tensor, dims: tuple[int, ...], pre_relu: bool, nonnegative: bool
) -> torch.Tensor:
    """Per unit, a value that is zero exactly when the unit is dead over ``dims``.

    ``max |x|`` for an activation's output, or, with ``pre_relu``, ``max(x, 0)``
    of the output that a functional ``F.relu`` consumes (its unit is dead when
    it is <= 0 for every sample). For a ``nonnegative`` ``x`` (>= 0 or NaN: a
    ReLU's output) ``max x`` is ``max |x|``, and the plain max is the cheapest
    per-unit reduction on a CPU. With no ``dims`` each value is its own unit.
    """
    import torch

    if not dims:
        return x.clamp(min=0) if pre_relu else x
    if pre_relu:
        return torch.amax(x, dim=dims).clamp_(min=0)
    if nonnegative:
        return torch.amax(x, dim=dims)
    if x.device.type == "cpu":
        # sum |x| is non-zero exactly when max |x| is (NaN and Inf alike); the CPU's
        # inf-norm over dims is a slow path (1.4-4x this, one kernel too)
        return torch.linalg.vector_norm(x, 1, dim=dims)  # type: ignore[no-any-return]
    return torch.linalg.vector_norm(x, math.inf, dim=dims)  # type: ignore[no-any-return]


def batchnorm_stats(modules: Sequence[Any]) -> torch.Tensor:
    """``[min mean, max mean, min var, max var]`` of each BatchNorm's running stats.

    Seven ops for all the modules (foreach reductions: torch has a ``_foreach_max``
    and no min, so a min is the max of the negated), not three per module: a ResNet
    has one BatchNorm per convolution, and they are read every step at check_every=1."""
    import torch

    stats = [m.running_mean for m in modules] + [m.running_var for m in modules]
    if len({t.dtype for t in stats}) > 1:  # stack needs one dtype: a module each
        rows = [batchnorm_stats([m]) for m in modules]
        return torch.cat(rows)
    highs = torch.stack(torch._foreach_max(stats))
    lows = torch.stack(torch._foreach_max(torch._foreach_neg(stats))).neg_()
    n = len(modules)
    return torch.stack([lows[:n], highs[:n], lows[n:], highs[n:]], dim=1).flatten().float()


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device: no NaN/Inf in it. Its min and max in one pass, not
    ``isfinite().all()``, which writes a bool per value first: on a CPU, 8 ms against
    0.45 ms for a language model's 2M logits (each step's capture, every op of a replay).
    Then ``low * 0 == high * 0``, four ops in all: a NaN or an Inf times 0 is NaN, which
    equals nothing (``isfinite`` of the pair and ``all`` were six)."""
    import torch

    t = _real(t)
    if not t.numel() or not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return low * 0 == high * 0


def finite_and_nan(t: torch.Tensor) -> tuple[bool, bool]:
    """Is ``t`` finite, and does it hold a NaN? One min/max pass and one host read: a NaN
    is both its min and its max (they propagate NaN), an infinity only one of them."""
    import torch

    t = _real(t)
    if not t.numel() or not t.is_floating_point():
        return True, False
    pair = torch.stack(torch.aminmax(t)).tolist()
    return all(math.isfinite(v) for v in pair), any(math.isnan(v) for v in pair)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (a NaN or Inf in either is one in it)."""
    import torch

    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the statistics take it: float32, or bfloat16/float16 as they are.

    A complex tensor counts as its real and imaginary parts (a NaN or Inf in
    either is one in it); float64 and float8 are converted. torch's float32
    norms refuse to narrow float64 and to read complex at all, so a float64
    model pays one conversion per watched tensor, and a finite value beyond
    float32's range (3.4e38) reads as Inf.
    """
    import torch

    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return x
    return x.float()


def dense_values(x: torch.Tensor) -> torch.Tensor | None:
    """The values of a tensor that is not dense and strided, as one dense tensor, for the
    statistics: a nested tensor's buffer, a sparse tensor's stored values (its implicit
    zeros are finite), an MKL-DNN tensor made dense. None for a meta tensor, which holds
    no values."""
    import torch

    if x.is_meta:
        return None
    if x.is_nested:
        return x.values()
    if x.layout is torch.sparse_coo:
        return x.coalesce().values()
    if x.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return x.values()
    return x.to_dense()


def shape_of(x: torch.Tensor) -> tuple[int, ...]:
    """``x.shape``; for a nested tensor, with -1 for each ragged dim (its components
    differ there; a strided nested tensor has no ``shape`` of its own)."""
    import torch

    if not x.is_nested or x.layout is not torch.strided:  # a jagged one has its own shape
        return x.shape
    sizes = x._nested_tensor_size()  # one row of sizes per component
    if not len(sizes):
        return (0,)
    return (len(sizes), *(int(d[0]) if bool((d == d[0]).all()) else -1 for d in sizes.T))


def first_tensor(value: Any, values_only: bool = False) -> torch.Tensor | None:
    """The tensor a module produced: itself, or the first one in a tuple/list/dict.
    ``values_only``: the first floating-point or complex one (``(mask, y)`` gives ``y``)."""
    import torch

    if isinstance(value, torch.Tensor):
        if values_only and not (value.is_floating_point() or value.is_complex()):
            return None
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return next((t for v in value if (t := first_tensor(v, values_only)) is not None), None)
    return None


@dataclasses.dataclass(frozen=True)
class ShapeContract:
    """An expected shape: ints, ``None``/``*`` (any), names (equal within a shape), one ``...``."""

    dims: tuple[int | str | None, ...]
    text: str

    @classmethod
    def parse(cls, spec: Any) -> ShapeContract:
        if isinstance(spec, ShapeContract):
            return spec
        if isinstance(spec, str):
            raw: list[Any] = (
                [d.strip() for d in spec.strip("()[] ").split(",")] if spec.strip() else []
            )
        elif isinstance(spec, (tuple, list)):
            raw = list(spec)
        else:
            raise ValueError(f"expected a shape like 'B,T,256' or (None, 10), got {spec!r}")
        dims = tuple(_dim(d, spec) for d in raw)
        if dims.count("...") > 1:
            raise ValueError(f"shape {spec!r} has more than one '...'")
        return cls(dims, "(" + ", ".join("*" if d is None else str(d) for d in dims) + ")")

    def mismatch(self, shape: Sequence[int]) -> str | None:
        """Why ``shape`` breaks the contract, or ``None`` when it holds."""
        dims = self._expand(len(shape))
        if dims is None:
            return f"has {len(shape)} dims, expected {self.text}"
        bound: dict[str, int] = {}
        for i, (want, got) in enumerate(zip(dims, shape, strict=True)):
            if isinstance(want, int) and want != got:
                return f"dim {i} is {got}, expected {want}"
            if isinstance(want, str) and bound.setdefault(want, got) != got:
                return f"dim {i} is {got}, but {want}={bound[want]} earlier in the shape"
        return None

    def carried_mismatch(self, shape: Sequence[int], carried: dict[str, int]) -> str | None:
        """Why ``shape`` breaks the sizes its names took in earlier calls (a T change, a
        (T,B,D) transpose), or ``None``. Batch names (``B``, ``N``) may change."""
        for i, (want, got) in enumerate(zip(self._expand(len(shape)) or (), shape, strict=True)):
            if isinstance(want, str) and want in carried and carried[want] != got:
                return f"dim {i} is {got}, but {want}={carried[want]} in earlier steps"
        return None

    def names(self, shape: Sequence[int]) -> dict[str, int]:
        """The sizes the contract's names take in ``shape`` (batch names left out)."""
        dims = self._expand(len(shape)) or ()
        return {
            want: got
            for want, got in zip(dims, shape, strict=True)
            if isinstance(want, str) and want not in BATCH_NAMES and want != "..."
        }

    def _expand(self, ndim: int) -> tuple[int | str | None, ...] | None:
        if "..." not in self.dims:
            return self.dims if len(self.dims) == ndim else None
        fixed = len(self.dims) - 1
        if ndim < fixed:
            return None
        i = self.dims.index("...")
        return (*self.dims[:i], *([None] * (ndim - fixed)), *self.dims[i + 1 :])


def _dim(value: Any, spec: Any) -> int | str | None:
    if value is None or value in ANY:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (value.isdigit() or value == "..." or NAME.match(value)):
        return int(value) if value.isdigit() else value
    raise ValueError(f"shape {spec!r}: {value!r} is not a size, a name, None/'*' or '...'")
