"""Host-side rule evaluation over the per-step stats the device produced.

The monitor hands one :class:`StepData` per training step, in order, after
each read. Counting (``consecutive``), baselines (gradient norms) and the
loss window live here, so they are exact per step whatever ``check_every``
is; mean |x| and dead units are measured on read steps only (``StepData.stats``).
A condition fires once when its streak reaches ``consecutive`` and then
stays quiet until it clears, so a NaN that persists is reported once.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

from breakpod._monitor.anomaly import Anomaly
from breakpod._monitor.baselines import EXPLODING, VANISHING, NormBaselines
from breakpod._monitor.peers import VIA_ALL_REDUCE, several_ranks
from breakpod._monitor.rules import Rule

FLIGHT_COLUMNS = 3  # L2 norm, min, max
# A slot's possible columns, in buffer order; a slot has those it watches (Slot.cell).
TOTAL, MEAN_ABS, ZEROS, NORM, LOW, HIGH = range(6)


@dataclasses.dataclass(frozen=True, slots=True)  # one per watched tensor stream
class Slot:
    """One watched tensor stream: a module's output (forward) or input gradient (backward)."""

    module: str
    phase: str
    rules: frozenset[str]
    total: bool = True  # the values start with sum(x): the non-finite signal
    mean_abs: bool = False
    zeros: bool = False  # the live-unit count, for dead_units
    pre_relu: bool = False  # units are dead when <= 0 (the output feeds a functional relu)
    flight: bool = False  # the flight recorder's columns: L2 norm, min, max (flight.py)
    retain: bool = False
    index: int = -1  # in the monitor's slot table
    base: int = -1  # first column in the per-step buffer
    abs_limit: float = math.inf  # the lowest max_mean_abs of the rules watching it
    zero_limit: float = math.inf  # the lowest max_zero_fraction likewise

    @property
    def rule_width(self) -> int:
        """The columns the rules judge: sum, sum |x|, live units (as watched)."""
        return int(self.total) + int(self.mean_abs) + int(self.zeros)

    @property
    def width(self) -> int:
        """Every column of the slot: the rules' first, then the flight recorder's."""
        return self.rule_width + FLIGHT_COLUMNS * int(self.flight)

    @property
    def columns(self) -> tuple[bool, bool, bool, bool, bool, bool]:
        """Which of TOTAL, MEAN_ABS, ZEROS, NORM, LOW, HIGH the slot has."""
        flight = self.flight
        return self.total, self.mean_abs, self.zeros, flight, flight, flight

    def cell(self, column: int) -> int:
        """Where ``column`` of this slot is in the per-step buffer; -1 without it."""
        has = self.columns
        return self.base + sum(has[:column]) if has[column] else -1

    @property
    def flags(self) -> tuple[bool, bool, bool, bool, bool]:
        """``(total, mean_abs, zeros, pre_relu, flight)``: what :func:`.checks.write_stats`
        writes."""
        return self.total, self.mean_abs, self.zeros, self.pre_relu, self.flight


@dataclasses.dataclass(frozen=True, slots=True)  # one per watched parameter
class ParamInfo:
    name: str
    module: str
    rules: frozenset[str]


@dataclasses.dataclass
class Sample:
    slot: Slot
    values: list[float]
    numel: int
    tensor: Any = None
    units: int = 0  # for dead_units: values[-1] is then the count of dead units
    consumer: str = ""  # for the batch (phase "input"): the first watched module that ran
    extremes: tuple[float, float] | None = None  # (min, max), from the flight columns

    @property
    def nonfinite(self) -> bool:
        return self.slot.total and not math.isfinite(self.values[0])

    @property
    def mean_abs(self) -> float:
        return self.values[int(self.slot.total)] / max(self.numel, 1)

    @property
    def dead_fraction(self) -> float:
        return self.values[-1] / max(self.units, 1)


@dataclasses.dataclass
class StepData:
    step: int
    forward: list[Sample] = dataclasses.field(default_factory=list)
    backward: list[Sample] = dataclasses.field(default_factory=list)
    grads: dict[int, float] = dataclasses.field(default_factory=dict)
    # the same norms, (parameter indices, host copy's slice) per device: read while judged
    grad_vectors: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    loss: float | None = None
    loss_tensor: Any = None
    params: dict[int, float] | None = None
    batchnorm: dict[str, list[float]] | None = None
    partial: bool = False  # only a loss, reported after the optimizer ended its step
    stats: bool = True  # activation statistics computed (check_every skips them between reads)
    # (ran slots, host values, kept tensors, units) per device, until expanded into samples
    slot_groups: list[tuple[Any, Any, Any, Any]] = dataclasses.field(default_factory=list)
    gate: dict[str, float] | None = None  # what the update gate decided on the device (gate.py)
    averaged: bool = False  # its gradients averaged over ranks by DDP (StepRecord.averaged)


Found = tuple[Anomaly, Rule]
THROUGH_ALL_REDUCE = f"; this rank's forward, loss and backward ran finite, so {VIA_ALL_REDUCE}"
OVERFLOW = "overflow"  # details["kind"]: finite values whose L2 norm or sum exceeds float32
# (phase "param" or "backward", step, parameter index) -> the tensor whose norm that was, or
# None once it is gone (a gradient read after its step)
Values = Callable[[str, int, int], Any]


class Detector:
    def __init__(
        self,
        rules: list[Rule],
        params: list[ParamInfo],
        batchnorm: dict[str, frozenset[str]],
        values: Values | None = None,
    ) -> None:
        self.rules = rules
        self.params = params
        self.batchnorm = batchnorm  # BatchNorm module -> names of the rules that watch it
        self.values = values
        self._streak: dict[tuple[Any, ...], int] = defaultdict(int)
        self._active: set[tuple[Any, ...]] = set()
        self._baselines: dict[str, NormBaselines] = {}  # per grad_norm rule
        self._losses: dict[str, deque[float]] = {}

    def run(self, data: StepData) -> list[Found]:
        found: list[Found] = []
        for rule in self.rules:
            if data.partial and rule.check not in ("nonfinite", "loss_spike"):
                continue
            check = getattr(self, f"_{rule.check}", None)
            if check is not None:
                found.extend(check(rule, data))
        return found

    def hot_modules(self) -> set[str]:
        """Modules with a per-module condition mid-streak or active: their samples must be seen
        even when fine, to clear it (the host builds samples only for flagged slots)."""
        hot = {key[1] for key, n in self._streak.items() if n > 0 and len(key) == 2}
        return hot | {key[1] for key in self._active if len(key) == 2}

    def ongoing(self, rule: str) -> bool:
        """Is an outbreak of the step-wide rule ``rule`` reported and not over yet?"""
        return (rule,) in self._active

    def _fires(self, key: tuple[Any, ...], cond: bool, rule: Rule) -> bool:
        """Edge-triggered streak counter: True once when ``cond`` held ``consecutive`` times."""
        if not cond:
            self._streak.pop(key, None)
            self._active.discard(key)
            return False
        self._streak[key] += 1
        if self._streak[key] >= rule.consecutive and key not in self._active:
            self._active.add(key)
            return True
        return False

    # nonfinite: the first producer in execution order, once per outbreak
    def _nonfinite(self, rule: Rule, data: StepData) -> Iterator[Found]:
        first = self._first_site(rule, data)
        if data.partial and first is None:
            return  # a late finite loss says nothing about the step's other tensors
        if self._fires((rule.name,), first is not None, rule) and first is not None:
            self._add_params(first, data)
            if _through_all_reduce(rule, first, data):
                first.summary += THROUGH_ALL_REDUCE
                first.details["another_rank"] = True
            yield first, rule

    def _first_site(self, rule: Rule, data: StepData) -> Anomaly | None:
        """The first site with NaN/Inf values; only without one, the first overflow."""
        overflow = None
        for site in self._nonfinite_sites(rule, data):
            if site is None:
                continue
            if site.details.get("kind") != OVERFLOW:
                return site
            overflow = overflow or site
        return overflow

    def _add_params(self, first: Anomaly, data: StepData) -> None:
        """Parameters that may be the cause: non-finite ones, and apart, finite ones whose
        norm overflowed."""
        bad: dict[str, list[str]] = {"nonfinite_params": [], "overflow_params": []}
        for i, norm in (data.params or {}).items():
            if not math.isfinite(norm):
                over = self._kind(("param", data.step, i), norm).get("kind") == OVERFLOW
                bad["overflow_params" if over else "nonfinite_params"].append(self.params[i].name)
        for key, names in bad.items():
            if names and first.phase != "param":  # a corrupt parameter may be the cause
                first.details[key] = names[:10]

    def _kind(self, where: tuple[str, int, int], norm: float) -> dict[str, Any]:
        """What a non-finite L2 norm hides: exact NaN/Inf counts, or an overflow of finite
        values (a host read of the tensor: anomalies only); ``{}`` once it is gone."""
        tensor = self.values(*where) if self.values is not None else None
        if tensor is None:
            return {"nan": "yes"} if math.isnan(norm) else {}
        from breakpod._monitor.summaries import nonfinite_counts

        counts = nonfinite_counts(tensor)
        if any(counts.values()):
            return dict(counts)
        return {"kind": OVERFLOW, "max_abs": float(tensor.detach().abs().max())}

    def _nonfinite_sites(self, rule: Rule, data: StepData) -> Iterator[Anomaly | None]:
        where = rule["where"]
        if "activation" in where:
            yield from (
                _nonfinite_sample(rule, data.step, s) for s in data.forward if _watched(rule, s)
            )
        loss = data.loss
        if (
            "loss" in where
            and not rule.yields_loss
            and loss is not None
            and not math.isfinite(loss)
        ):
            yield _anomaly(rule, data, "", "loss", f"loss is {loss}", loss, data.loss_tensor)
        if "gradient" in where:
            yield from (
                _nonfinite_sample(rule, data.step, s) for s in data.backward if _watched(rule, s)
            )
            yield from self._nonfinite_norms(rule, data, data.grads, "backward", "gradient of")
        if "param" in where and data.params is not None:
            yield from self._nonfinite_norms(rule, data, data.params, "param", "parameter")

    def _nonfinite_norms(
        self, rule: Rule, data: StepData, norms: dict[int, float], phase: str, what: str
    ) -> Iterator[Anomaly]:
        if math.isfinite(sum(norms.values())):
            return  # norms are >= 0, so their sum is finite only when each one is
        for index, norm in norms.items():
            info = self.params[index]
            if rule.name in info.rules and not math.isfinite(norm):
                kind = self._kind((phase, data.step, index), norm)
                summary = _norm_summary(f"{what} {info.name}", norm, kind)
                details = {"param": info.name, **kind}
                yield _anomaly(rule, data, info.module, phase, summary, norm, details=details)

    def _activation(self, rule: Rule, data: StepData) -> Iterator[Found]:
        if not data.stats:
            return  # not measured this step: a streak neither grows nor clears
        limit = rule["max_mean_abs"]
        for s in data.forward:
            if _watched(rule, s) and self._fires(
                (rule.name, s.slot.module), s.mean_abs > limit, rule
            ):
                summary = f"output mean |x| = {s.mean_abs:.4g} above max_mean_abs {limit:g}"
                yield (
                    _anomaly(rule, data, s.slot.module, "forward", summary, s.mean_abs, s.tensor),
                    rule,
                )

    def _dead_units(self, rule: Rule, data: StepData) -> Iterator[Found]:
        if not data.stats:
            return
        limit = rule["max_zero_fraction"]
        for s in data.forward:
            if _watched(rule, s) and self._fires(
                (rule.name, s.slot.module), s.dead_fraction >= limit, rule
            ):
                times = f", {rule.consecutive} steps in a row" if rule.consecutive > 1 else ""
                what = "<= 0 (before relu)" if s.slot.pre_relu else "zero"
                summary = (
                    f"{s.values[-1]:.0f} of {s.units} units ({s.dead_fraction:.1%}) are {what} "
                    f"over the whole batch{times}"
                )
                details = {"dead_units": int(s.values[-1]), "units": s.units}
                anomaly = _anomaly(
                    rule,
                    data,
                    s.slot.module,
                    "forward",
                    summary,
                    s.dead_fraction,
                    s.tensor,
                    details,
                )
                yield anomaly, rule

    def baselines(self, rule: Rule) -> NormBaselines:
        """A ``grad_norm`` rule's baselines, made on first use."""
        baselines = self._baselines.get(rule.name)
        if baselines is None:
            baselines = self._baselines[rule.name] = NormBaselines(rule, self.params)
        return baselines

    def _grad_norm(self, rule: Rule, data: StepData) -> Iterator[Found]:
        baselines = self.baselines(rule)
        verdicts, seen = baselines.judge(data.grads, data.grad_vectors)
        keys = (*self._streak, *self._active)
        streaks = {k[1] for k in keys if len(k) == 3 and k[0] == rule.name}
        # out of range now, or before (a streak to count or clear): the others need nothing
        counted = set(verdicts) | {baselines.position[group] for group in streaks}
        fired: dict[str, list[tuple[float, Anomaly]]] = {EXPLODING: [], VANISHING: []}
        for g in sorted(counted):
            if not seen[g]:
                continue  # no gradient this step
            group = baselines.names[g]
            kind_now, norm, summary, past = verdicts.get(g, ("", math.nan, "", 0.0))
            for kind in (EXPLODING, VANISHING):
                if self._fires((rule.name, group, kind), kind_now == kind, rule):
                    module = group if rule["group"] == "module" else group.rpartition(".")[0]
                    details = {"group": group, "kind": kind}
                    anomaly = _anomaly(rule, data, module, "backward", summary, norm, None, details)
                    fired[kind].append((past, anomaly))
        for kind in (EXPLODING, VANISHING):
            for anomaly in _said(fired[kind]):
                yield anomaly, rule

    def _loss_spike(self, rule: Rule, data: StepData) -> Iterator[Found]:
        loss = data.loss
        if loss is None or not math.isfinite(loss) or rule.yields_loss:
            return
        window = self._losses.setdefault(rule.name, deque(maxlen=rule["window"]))
        history = len(window)  # the steps the median covers, before this one joins
        median = statistics.median(window) if history >= rule["min_history"] else math.nan
        spike = median > 0 and loss > rule["factor"] * median
        window.append(loss)
        if self._fires((rule.name,), spike, rule):
            summary = (
                f"loss {loss:.4g} is {loss / median:.3g}x the median {median:.4g} "
                f"of the last {history} steps"
            )
            yield _anomaly(rule, data, "", "loss", summary, loss, data.loss_tensor), rule

    def _batchnorm(self, rule: Rule, data: StepData) -> Iterator[Found]:
        (mlo, mhi), (vlo, vhi) = rule["mean_range"], rule["var_range"]
        for module, (m0, m1, v0, v1) in (data.batchnorm or {}).items():
            bad = not (mlo <= m0 and m1 <= mhi and vlo <= v0 and v1 <= vhi)
            if rule.name in self.batchnorm.get(module, ()) and self._fires(
                (rule.name, module), bad, rule
            ):
                summary = (
                    f"running mean in [{m0:.4g}, {m1:.4g}], var in [{v0:.4g}, {v1:.4g}]; "
                    f"allowed mean {mlo:g}..{mhi:g}, var {vlo:g}..{vhi:g}"
                )
                yield (
                    _anomaly(rule, data, module, "param", summary, max(abs(m0), abs(m1), v1)),
                    rule,
                )


def _watched(rule: Rule, sample: Sample) -> bool:
    return rule.name in sample.slot.rules


def _norm_summary(what: str, norm: float, kind: dict[str, Any]) -> str:
    if kind.get("kind") == OVERFLOW:
        return (
            f"{what}: every value is finite, but its L2 norm overflows float32 "
            f"(overflow; largest |x| {kind['max_abs']:.3g})"
        )
    if not kind:  # read after its step: the values are gone
        return f"{what}: L2 norm {norm} (NaN/Inf values or an overflow; read too late to tell)"
    return f"{what} has non-finite values (L2 norm {norm})"


def _through_all_reduce(rule: Rule, first: Anomaly, data: StepData) -> bool:
    """Is a parameter's non-finite gradient the step's first site on this rank, with its
    forward, loss and backward checked and finite, and its gradients averaged by DDP?
    Then it came from another rank's. (The sentinel's replay says so too: sentinel.py.)"""
    if not data.averaged or not data.stats:
        return False
    checked = all(w in rule["where"] for w in ("activation", "loss"))
    grad_of_param = first.phase == "backward" and "param" in first.details
    return checked and grad_of_param and several_ranks()


def _nonfinite_sample(rule: Rule, step: int, s: Sample) -> Anomaly | None:
    if not s.nonfinite:
        return None
    details = _nonfinite_kinds(s)
    module = s.consumer if s.slot.phase == "input" else s.slot.module
    what = {
        "input": f"input of {module or '<model>'} (the batch)",
        "forward": f"output of {module or '<model>'}",
    }.get(s.slot.phase, f"gradient w.r.t. the input of {module or '<model>'}")
    if details.get("kind") == OVERFLOW:
        summary = f"{what}: every value is finite, but their sum overflows float32 (overflow)"
        value = math.inf
    else:
        counts = " ".join(f"{k}={v}" for k, v in details.items())
        if "yes" in details.values() and "nan" not in details:  # an infinite sum, unread
            counts += ", or finite values whose sum overflows float32"
        summary = f"{what} has non-finite values ({counts})"
        value = float(sum(details.values())) if s.tensor is not None else math.nan
    if s.slot.phase == "input":
        details["batch"] = True
    return Anomaly(
        rule.name, rule.check, module, step, s.slot.phase, summary, value, details, s.tensor
    )


def _nonfinite_kinds(s: Sample) -> dict[str, Any]:
    """Exact counts when the tensor was kept, else which kinds are present (from min/max);
    an overflow when every value is finite (the sum of values near float32's limit)."""
    if s.tensor is not None:
        from breakpod._monitor.summaries import nonfinite_counts

        counts = nonfinite_counts(s.tensor)
        return dict(counts) if any(counts.values()) else {"kind": OVERFLOW}
    if s.extremes is not None and all(math.isfinite(v) for v in s.extremes):
        return {"kind": OVERFLOW}
    total = s.values[0]
    if math.isnan(total):
        return {"nan": "yes"}  # or +Inf and -Inf together: exact counts need the tensor
    return {"+inf" if total > 0 else "-inf": "yes"}


SAID_ALONE = 3  # groups of one rule out of range in a step, each its own anomaly
LISTED = 20  # groups a grouped anomaly names in details["groups"]


def _said(fired: list[tuple[float, Anomaly]]) -> list[Anomaly]:
    """A rule's groups out of range the same way in one step: each its own anomaly, up to
    ``SAID_ALONE``; beyond, one (a spike through the whole model is one event and one
    line, not one per module), the group furthest past its limit, naming the others."""
    if len(fired) <= SAID_ALONE:
        return [anomaly for _, anomaly in fired]
    ranked = [anomaly for _, anomaly in sorted(fired, key=lambda f: -f[0])]
    first, others = ranked[0], [a.details["group"] for a in ranked[1:]]
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    first.summary += f"; {len(others)} more groups at this step ({shown})"
    first.details["groups"] = [first.details["group"], *others][:LISTED]
    first.details["groups_out"] = len(ranked)
    return [first]


def _anomaly(
    rule: Rule,
    data: StepData,
    module: str,
    phase: str,
    summary: str,
    value: float,
    tensor: Any = None,
    details: dict[str, Any] | None = None,
) -> Anomaly:
    return Anomaly(
        rule.name, rule.check, module, data.step, phase, summary, value, details or {}, tensor
    )
