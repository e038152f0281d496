"""The flight recorder's dump as data and as a table (standard library only, so the
CLI renders what an event carried without loading the monitors).

A series is one watched tensor stream (a module's output or input gradient, or
the loss) over the kept steps. Its first bad step is the first non-finite one
(NaN, +Inf, -Inf, or an L2 norm that overflowed float32) or the first out of
range: ``max |x|`` above ``JUMP`` times its median over at least ``BASELINE``
steps before.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import Any

JUMP = 100.0  # max |x| this many times its running median is out of range
BASELINE = 4  # steps of history a jump is judged against
TREND = 6  # steps shown before the first bad one
EVENT_ROWS = 32  # series an event carries (earliest first); the rest are counted


@dataclasses.dataclass
class Series:
    """One module's (or the loss's) values over the kept steps."""

    module: str
    phase: str
    steps: list[int] = dataclasses.field(default_factory=list)
    when: list[int] = dataclasses.field(default_factory=list)  # order within each step
    rms: list[float] = dataclasses.field(default_factory=list)
    max_abs: list[float] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)

    def add(self, step: int, when: int, rms: float, max_abs: float, kind: str) -> None:
        self.steps.append(step)
        self.when.append(when)
        self.rms.append(rms)
        self.max_abs.append(max_abs)
        self.kinds.append(kind)

    def first_bad(self) -> tuple[int, str] | None:
        """``(position, why)`` of the first non-finite or out-of-range step.

        The steps before are kept sorted as the walk goes (one insertion a step, not
        a sort): a dump judges every watched tensor's series, thousands of them."""
        before: list[float] = []  # the finite max |x| of the steps so far, sorted
        for i, (kind, value) in enumerate(zip(self.kinds, self.max_abs, strict=True)):
            if kind:
                return i, kind
            if len(before) >= BASELINE and self.phase != "loss":
                median = _median(before)
                if median > 0 and value > JUMP * median:
                    what = "|g|" if self.phase == "grad" else "max|x|"  # a gradient's norm
                    return i, f"{what} {value:.3g} = {value / median:.0f}x median"
            if math.isfinite(value):
                bisect.insort(before, value)
        return None


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclasses.dataclass
class Flight:
    """A dump: the kept steps, and every series in them."""

    steps: list[int]
    step_seconds: list[float]
    series: list[Series]

    def fields(self, limit: int = EVENT_ROWS) -> dict[str, Any]:
        """What an event carries: each series that went bad (earliest first, at most
        ``limit``) with its trend, and counts of the rest."""
        bad = sorted(
            ((s, *found) for s in self.series if (found := s.first_bad()) is not None),
            key=lambda item: (item[0].steps[item[1]], item[0].when[item[1]]),
        )
        rows = [_bad_row(s, i, why) for s, i, why in bad[:limit]]
        seconds = self.step_seconds
        return {
            "steps": [self.steps[0], self.steps[-1]] if self.steps else [],
            "kept": len(self.steps),
            "watched": sum(1 for s in self.series if s.phase != "loss"),
            "first_bad": rows,
            "more": max(0, len(bad) - limit),
            "step_seconds": {
                "median": statistics.median(seconds) if seconds else None,
                "last": seconds[-1] if seconds else None,
            },
        }


def _bad_row(series: Series, i: int, why: str) -> dict[str, Any]:
    start = max(0, i - TREND)
    return {
        "module": series.module,
        "phase": series.phase,
        "step": series.steps[i],
        "why": why,
        "trend_steps": series.steps[start : i + 1],
        "rms": series.rms[start : i + 1],
        "max_abs": series.max_abs[start : i + 1],
    }


def lines(fields: Mapping[str, Any]) -> list[str]:
    """The table of a dump's :meth:`Flight.fields`, also as an event carried it (an
    agent's event is read as it came: a field of the wrong shape is left out)."""
    if fields.get("unavailable"):
        return [f"flight recorder: {fields['unavailable']}"]
    steps = _listed(fields.get("steps"))
    if not steps:
        return ["flight recorder: no step recorded yet"]
    out = [
        f"flight recorder: steps {steps[0]}-{steps[-1]} ({fields.get('kept', '?')} kept), "
        f"{fields.get('watched', '?')} watched tensors"
    ]
    timing = fields.get("step_seconds")
    if isinstance(timing, Mapping) and timing.get("median") is not None:
        out.append(f"step time: median {_ms(timing['median'])}, last {_ms(timing.get('last'))}")
    rows = [_cells(r) for r in _listed(fields.get("first_bad")) if isinstance(r, Mapping)]
    if not rows:
        out.append("every watched tensor stayed finite and in range")
        return out
    out.append("first bad step per module (earliest first), and its RMS up to that step:")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        name, phase, step, why = (cell.ljust(w) for cell, w in zip(r[:4], widths, strict=True))
        out.append(f"  {name}  {phase}  step {step}  {why}  {r[4]}")
    if fields.get("more"):
        out.append(f"  ... and {fields['more']} more")
    return out


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _cells(row: Mapping[str, Any]) -> list[str]:
    """module, phase, step, why, and the trend with its label, as text."""
    phase = str(row.get("phase", "?"))
    label = "loss" if phase == "loss" else "rms"
    trend = " ".join(_num(v) for v in _listed(row.get("rms")))
    name = str(row.get("module") or "<model>")
    return [name, phase, str(row.get("step", "?")), str(row.get("why", "?")), f"{label} {trend}"]


def series_lines(series: Series) -> list[str]:
    """One series step by step: ``step  rms  max|x|  non-finite kind``."""
    value = "loss" if series.phase == "loss" else "rms"
    out = [f"{series.module or '<model>'} {series.phase}: step, {value}, max|x|"]
    for step, rms, max_abs, kind in zip(
        series.steps, series.rms, series.max_abs, series.kinds, strict=True
    ):
        out.append(f"  {step:<6}  {_num(rms):>10}  {_num(max_abs):>10}  {kind}".rstrip())
    return out


def _ms(seconds: Any) -> str:
    try:
        return f"{float(seconds) * 1000:.1f} ms"
    except (TypeError, ValueError):
        return "?"


def _num(value: Any) -> str:
    try:
        return f"{float(value):.3g}"
    except (TypeError, ValueError):
        return str(value)  # "nan"/"inf" as strict JSON carried them
