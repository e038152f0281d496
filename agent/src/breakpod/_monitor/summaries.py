"""``breakpod.summary(t)``: one line about a tensor, never the tensor itself.

    tensor[16,64,32,32] f32 cuda:0 2.1Mb x∈[-3.2, 4.1] μ=0.01 σ=1.0 nan=3 inf=0 grad

Statistics are taken over the finite values, in float64 so that values near
float32's limit do not overflow them (float32 on MPS, which has no float64).
This reads the tensor on the host, so it is for debugger sessions and reports,
not for hooks. A complex tensor is counted by its real and imaginary parts;
sparse, nested, MKL-DNN and quantized tensors by their values; a meta tensor
has none.
"""

from __future__ import annotations

from typing import Any

DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
    "complex128": "c128",
}


def summary(t: Any) -> str:
    """A one-line description of ``t`` (a tensor, or anything else via ``repr``)."""
    import torch

    if isinstance(t, torch.nn.Parameter | torch.Tensor):
        if torch.nn.parameter.is_lazy(t):
            return "uninitialized parameter (a lazy module's, before its first call)"
        return _tensor(t)
    own = getattr(t, "summary_line", None)
    if callable(own):  # a Monitor: the counts first, so a cut never loses them
        return str(own())
    text = repr(t)
    return text if len(text) <= 120 else text[:117] + "..."


def nonfinite_counts(t: Any) -> dict[str, int]:
    """``{"nan": n, "+inf": n, "-inf": n}`` counted exactly (a host read)."""
    import torch

    if torch.nn.parameter.is_lazy(t):  # no values yet
        return {"nan": 0, "+inf": 0, "-inf": 0}
    x = _readable(t.detach())
    if x is None or not x.is_floating_point():
        return {"nan": 0, "+inf": 0, "-inf": 0}
    stats = _Stats()
    for chunk in _chunks(x):
        stats.count(chunk)
    return stats.nonfinite()


CHUNK = 1 << 20  # values read at a time: a few MiB beside a tensor of any size


def _chunks(x: Any) -> Any:
    """``x``'s values, a chunk at a time (views, copied one chunk at a time)."""
    if x.dim() == 0 or x.is_contiguous():
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield flat[start : start + CHUNK]
        return
    rows = max(1, CHUNK // max(1, x[0].numel()))
    for start in range(0, x.shape[0], rows):
        yield from _chunks(x[start : start + rows].contiguous())


class _Stats:
    """Counts, extremes, mean and variance over chunks (Chan et al.'s merge), in float64."""

    def __init__(self) -> None:
        self.nan = self.posinf = self.neginf = self.n = 0
        self.lo, self.hi, self.mean, self.m2 = float("inf"), float("-inf"), 0.0, 0.0

    def count(self, chunk: Any) -> Any:
        import torch

        wide = chunk.to(torch.float32 if chunk.device.type == "mps" else torch.float64)
        self.nan += int(torch.isnan(wide).sum())
        self.posinf += int(torch.isposinf(wide).sum())
        self.neginf += int(torch.isneginf(wide).sum())
        return wide

    def add(self, chunk: Any) -> None:
        import torch

        wide = self.count(chunk)
        finite = wide[torch.isfinite(wide)]
        n = finite.numel()
        if not n:
            return
        mean = float(finite.mean())
        m2 = float(((finite - mean) ** 2).sum())
        self.lo, self.hi = min(self.lo, float(finite.min())), max(self.hi, float(finite.max()))
        total = self.n + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.n * n / total
        self.mean += delta * n / total
        self.n = total

    def nonfinite(self) -> dict[str, int]:
        return {"nan": self.nan, "+inf": self.posinf, "-inf": self.neginf}


def _tensor(t: Any) -> str:
    from breakpod._monitor.checks import shape_of
    from breakpod._monitor.sharding import local, shard_of

    x = local(t).detach()  # a DTensor: this rank's shard (the others' would need them)
    dtype = DTYPES.get(str(x.dtype).removeprefix("torch."), str(x.dtype).removeprefix("torch."))
    size = _size(x.numel() * x.element_size())
    head = f"tensor[{','.join(map(str, shape_of(x)))}] {dtype} {x.device} {size}{shard_of(t)}"
    values = _readable(x)
    parts = [head, *(_values(values) if values is not None else [])]
    if t.requires_grad:
        parts.append("grad")
    if t.grad is not None if t.is_leaf else False:
        parts.append(f"|grad|={float(local(t.grad).detach().float().norm()):.3g}")
    return " ".join(parts)


def _readable(x: Any) -> Any:
    """``x`` as a dense real tensor whose values a summary reads; None for a meta tensor."""
    import torch

    from breakpod._monitor.checks import dense_values

    if x.is_quantized:
        x = x.dequantize()
    if x.layout is not torch.strided or x.is_nested or x.is_meta:
        x = dense_values(x)
    if x is not None and x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    return x


def _values(x: Any) -> list[str]:
    import torch

    if x.numel() == 0:
        return []
    if x.dtype == torch.bool:
        return [f"true={int(x.sum())}"]
    stats = _Stats()
    for chunk in _chunks(x):
        stats.add(chunk)
    out = []
    if stats.n:
        std = (stats.m2 / (stats.n - 1)) ** 0.5 if stats.n > 1 else 0.0
        out += [f"x∈[{stats.lo:.3g}, {stats.hi:.3g}]", f"μ={stats.mean:.3g}", f"σ={std:.3g}"]
    return [*out, f"nan={stats.nan}", f"inf={stats.posinf + stats.neginf}"]


def _size(nbytes: int) -> str:
    for unit in ("b", "Kb", "Mb", "Gb"):
        if nbytes < 1024 or unit == "Gb":
            return f"{nbytes:.0f}{unit}" if unit == "b" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")
