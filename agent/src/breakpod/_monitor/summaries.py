"""``breakpod.summary(t)``: one line about a tensor, never the tensor itself.

    tensor[16,64,32,32] f32 cuda:0 2.1Mb x∈[-3.2, 4.1] μ=0.01 σ=1.0 nan=3 inf=0 grad

Statistics are taken over the finite values; this reads the tensor on the
host, so it is for debugger sessions and reports, not for hooks.
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
}


def summary(t: Any) -> str:
    """A one-line description of ``t`` (a tensor, or anything else via ``repr``)."""
    import torch

    if isinstance(t, torch.nn.Parameter | torch.Tensor):
        return _tensor(t)
    own = getattr(t, "summary_line", None)
    if callable(own):  # a Monitor: the counts first, so a cut never loses them
        return str(own())
    text = repr(t)
    return text if len(text) <= 120 else text[:117] + "..."


def nonfinite_counts(t: Any) -> dict[str, int]:
    """``{"nan": n, "+inf": n, "-inf": n}`` counted exactly (a host read)."""
    import torch

    x = t.detach()
    if not (x.is_floating_point() or x.is_complex()):
        return {"nan": 0, "+inf": 0, "-inf": 0}
    return {
        "nan": int(torch.isnan(x).sum()),
        "+inf": int(torch.isposinf(x).sum()),
        "-inf": int(torch.isneginf(x).sum()),
    }


def _tensor(t: Any) -> str:
    x = t.detach()
    dtype = DTYPES.get(str(x.dtype).removeprefix("torch."), str(x.dtype).removeprefix("torch."))
    size = _size(x.numel() * x.element_size())
    head = f"tensor[{','.join(map(str, x.shape))}] {dtype} {x.device} {size}"
    parts = [head, *_values(x)]
    if t.requires_grad:
        parts.append("grad")
    if t.grad is not None if t.is_leaf else False:
        parts.append(f"|grad|={float(t.grad.detach().float().norm()):.3g}")
    return " ".join(parts)


def _values(x: Any) -> list[str]:
    import torch

    if x.numel() == 0 or x.is_complex() or x.is_meta:
        return []
    if x.dtype == torch.bool:
        return [f"true={int(x.sum())}"]
    finite = x[torch.isfinite(x)]  # a copy of the finite values only
    finite = (
        finite.float() if finite.element_size() < 4 or not finite.is_floating_point() else finite
    )
    counts = nonfinite_counts(x)
    out = []
    if finite.numel():
        lo, hi = float(finite.min()), float(finite.max())
        std = float(finite.std()) if finite.numel() > 1 else 0.0
        out += [f"x∈[{lo:.3g}, {hi:.3g}]", f"μ={float(finite.mean()):.3g}", f"σ={std:.3g}"]
    return [*out, f"nan={counts['nan']}", f"inf={counts['+inf'] + counts['-inf']}"]


def _size(nbytes: int) -> str:
    for unit in ("b", "Kb", "Mb", "Gb"):
        if nbytes < 1024 or unit == "Gb":
            return f"{nbytes:.0f}{unit}" if unit == "b" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")
