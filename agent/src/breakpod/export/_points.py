"""What an exporter writes: metric names and values, with no non-finite value disguised.

Pure functions of the monitor's per-step host floats (no torch). A finite value
is written as it is. A non-finite one is never written raw (TensorBoard hides
finite points between NaNs, MLflow clamps ±Inf to ±1.8e308 and its run page has
failed on NaN): its series gets a companion ``…/nonfinite`` = 1 at that step,
and ``…/nonfinite/nan``, ``…/nonfinite/posinf`` or ``…/nonfinite/neginf`` = 1
says which kind it was.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PREFIX = "breakpod"
MODEL = "<model>"  # the module name of the model itself (its own parameters)
KIND_SUFFIX = {"nan": "nan", "+inf": "posinf", "-inf": "neginf"}


def nonfinite_kind(value: float) -> str | None:
    """``"nan"``, ``"+inf"``, ``"-inf"``, or None for a finite value."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return None


def encode(values: Mapping[str, float], sep: str = "/") -> dict[str, float]:
    """Finite values as they are; each non-finite one as its companion flags."""
    out: dict[str, float] = {}
    for name, value in values.items():
        kind = nonfinite_kind(value)
        if kind is None:
            out[name] = float(value)
            continue
        out[f"{name}{sep}nonfinite"] = 1.0
        out[f"{name}{sep}nonfinite{sep}{KIND_SUFFIX[kind]}"] = 1.0
    return out


def step_metrics(data: Any, params: Sequence[Any]) -> dict[str, float]:
    """One step's loss, gradient norms (global and per module) and non-finite tensor counts.

    ``data`` is a monitor's ``StepData``; ``params`` its ``ParamInfo`` list (the
    gradient norms are keyed by index into it).
    """
    out: dict[str, float] = {}
    if data.loss is not None:
        out[f"{PREFIX}/loss"] = data.loss
    if data.grads:
        out.update(_grad_norms(data.grads, params))
    if data.grads or data.forward or data.backward:
        counts = nonfinite_tensors(data, params)
        out[f"{PREFIX}/nonfinite_tensors/total"] = float(sum(counts.values()))
        out.update({f"{PREFIX}/nonfinite_tensors/{m}": float(n) for m, n in counts.items()})
    return out


def _grad_norms(grads: Mapping[int, float], params: Sequence[Any]) -> dict[str, float]:
    by_module: dict[str, list[float]] = defaultdict(list)
    for index, norm in grads.items():
        by_module[params[index].module or MODEL].append(norm)
    out = {f"{PREFIX}/grad_norm/global": combined_norm(grads.values())}
    for module, norms in sorted(by_module.items()):
        out[f"{PREFIX}/grad_norm/{module}"] = combined_norm(norms)
    return out


def combined_norm(norms: Iterable[float]) -> float:
    """The L2 norm of the concatenation, from the parts' norms (NaN if any part is NaN)."""
    parts = list(norms)
    if any(math.isnan(n) for n in parts):
        return math.nan
    return math.hypot(*parts)  # scaled: large finite norms do not overflow to inf


def nonfinite_tensors(data: Any, params: Sequence[Any]) -> dict[str, int]:
    """Per module, how many of its watched tensors held a NaN/Inf this step (only those > 0):
    outputs, input gradients and parameter gradients."""
    counts: dict[str, int] = defaultdict(int)
    for sample in [*data.forward, *data.backward]:
        if sample.nonfinite:
            counts[sample.slot.module or MODEL] += 1
    for index, norm in data.grads.items():
        if not math.isfinite(norm):
            counts[params[index].module or MODEL] += 1
    return dict(counts)
