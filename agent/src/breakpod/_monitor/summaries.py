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
    x = x if x.element_size() >= 2 else x.float()  # float8: few ops take it
    return {
        "nan": int(torch.isnan(x).sum()),
        "+inf": int(torch.isposinf(x).sum()),
        "-inf": int(torch.isneginf(x).sum()),
    }


def _tensor(t: Any) -> str:
    from breakpod._monitor.checks import shape_of

    x = t.detach()
    dtype = DTYPES.get(str(x.dtype).removeprefix("torch."), str(x.dtype).removeprefix("torch."))
    size = _size(x.numel() * x.element_size())
    head = f"tensor[{','.join(map(str, shape_of(x)))}] {dtype} {x.device} {size}"
    values = _readable(x)
    parts = [head, *(_values(values) if values is not None else [])]
    if t.requires_grad:
        parts.append("grad")
    if t.grad is not None if t.is_leaf else False:
        parts.append(f"|grad|={float(t.grad.detach().float().norm()):.3g}")
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
    counts = nonfinite_counts(x)
    wide = x.to(torch.float32 if x.device.type == "mps" else torch.float64)  # MPS: no f64
    finite = wide[torch.isfinite(wide)]  # a copy of the finite values only
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
