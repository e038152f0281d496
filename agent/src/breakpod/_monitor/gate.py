"""A fused optimizer's update gate: a step whose gradients are non-finite is not
applied, decided on the device, with no host read.

GradScaler's mechanism: torch's fused optimizers (``fused=True`` Adam, AdamW, SGD,
Adagrad) read ``optimizer.found_inf`` in their step and leave the parameters and
their state untouched where it is non-zero. Between the monitor's reads
(``check_every > 1``), or on a GPU before a read has landed, nobody on the host
knows a step's verdict when ``optimizer.step()`` runs: the gate hands the fused
kernel the step's own, a device flag that is 1 where a gradient norm is NaN/Inf.
So a NaN update is never applied behind the monitor's back, and the read that
later finds the step says its update was skipped on the device.

A step whose anomaly parked the job is the engineer's (or ``BREAKPOD_ON_EXPIRE``'s)
to decide: ``continue`` applies it, ``skip`` drops it, and the gate stays open.
Under GradScaler, which sets ``found_inf`` itself, the gate stays out of the way.
Other optimizers (for-loop and foreach ones) refuse the flag, so the gate is used
with fused ones only; ``BREAKPOD_SKIP_ON_DEVICE=0`` turns it off.

A ``grad_norm`` rule whose action is ``skip`` closes the gate too, judged on the
device (norm_limits.py), so it needs no read before each update. Each step's
verdicts (NaN/Inf, and each such rule's) travel to the host with its statistics,
in the same copy: what the device decided is known at the read without another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.config import env_flag
from breakpod._monitor.baselines import NormBaselines
from breakpod._monitor.norm_limits import NormLimits, judged_on_device
from breakpod._monitor.rules import Rule
from breakpod._monitor.stats import Entry, StepRecord

SKIP_ON_DEVICE_ENV = "BREAKPOD_SKIP_ON_DEVICE"
SKIPPED_ON_DEVICE = "on the device: the fused optimizer's found_inf (its gradients were non-finite)"
NONFINITE = "nonfinite"  # the verdict of the step's NaN/Inf, beside each rule's (by name)
KEPT = 64  # verdicts kept for steps judged before their update (a park may decide them)


def gate_for(
    optimizer: Any,
    rules: Sequence[Rule] = (),
    baselines_of: Callable[[Rule], NormBaselines] | None = None,
) -> UpdateGate | None:
    """A gate for ``optimizer`` when its step takes ``found_inf`` (a fused one), else None;
    ``rules`` whose skips it decides on the device, with their baselines' source."""
    if optimizer is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    if not env_flag(SKIP_ON_DEVICE_ENV, True):
        return None
    limits = [NormLimits(r, baselines_of) for r in rules if baselines_of and judged_on_device(r)]
    return UpdateGate(optimizer, limits)


class UpdateGate:
    """Sets ``found_inf`` before each update it guards and takes it away after."""

    def __init__(self, optimizer: Any, limits: Sequence[NormLimits] = ()) -> None:
        self.optimizer = optimizer
        self.limits = list(limits)  # the skip rules it judges on the device
        self.rules = {lim.rule.name for lim in self.limits}
        self.verdicts: dict[int, dict[str, float]] = {}  # judged before the update: decided?
        self._mine: Any = None  # the found_inf the gate set, until its update
        self._under: Any = None  # GradScaler's, which the rules' verdicts joined
        self._deciding: int | None = None  # a step judged before its update: a park may decide

    def close(self, record: StepRecord) -> None:
        """Before ``record``'s update, its gradients collected and not yet read: the fused
        kernel will skip the update if one of them is NaN/Inf, or a rule's norm leaves its
        range. The verdicts join the step's statistics, read with them. Under GradScaler,
        which set ``found_inf`` for this update, the scaler's NaN/Inf verdict stands and the
        rules' join it (its backoff still follows its own overflows only)."""
        scaler = vars(self.optimizer).get("found_inf")
        if scaler is self._mine:
            scaler = None  # ours still, from an update that raised before its post-hook
        grads = [e for e in record.entries if e.kind == "grads"]
        if not grads or (scaler is not None and not self.limits):
            return
        import torch

        names, flags = ([], []) if scaler is not None else ([NONFINITE], [_nonfinite_flag(grads)])
        for limits in self.limits if len(grads) == 1 else ():  # one device holds the norms
            leaves = limits.leaves_range(grads[0].keys, grads[0].vec)
            if leaves is not None:
                names.append(limits.rule.name)
                flags.append(leaves.float())
        if not flags:
            return
        # found_inf is 1.0 or 0.0: the fused kernels skip an update where it equals 1.0 and
        # apply it for any other value, so two verdicts are never added (2.0 would apply it)
        verdicts = torch.stack(flags) if len(flags) > 1 else flags[0].reshape(1)
        found = verdicts.amax() if len(flags) > 1 else flags[0]
        if scaler is not None:
            found = torch.maximum(scaler, found.to(scaler.device, scaler.dtype))
        self.optimizer.found_inf = self._mine = found
        self._under = scaler
        self._deciding = record.step
        record.entries.append(Entry("gate", verdicts, keys=tuple(names)))

    def settle(self, step: int, parked: bool, anomalies: list[Any]) -> bool:
        """After the host judged ``step`` (or not) and before its update: a park decided
        the update (the gate opens, to the scaler's verdict if any), else its findings so
        far say the device skips it."""
        self._deciding = None
        if parked:
            self.verdicts.pop(step, None)
            if self._mine is not None and self._under is not None:
                self.optimizer.found_inf = self._under
            self.after_update()
            return False
        verdict = self.verdicts.pop(step, None)
        return verdict is not None and self.mark(step, anomalies, verdict)

    def after_update(self, *_: Any) -> None:
        """The optimizer's step post-hook: found_inf is the gate's for one step only (the
        scaler takes away its own)."""
        if vars(self.optimizer).get("found_inf") is self._mine and self._under is None:
            vars(self.optimizer).pop("found_inf", None)
        self._mine = self._under = None

    def mark(self, step: int, anomalies: list[Any], verdict: dict[str, float] | None) -> bool:
        """Say what the device did with ``step``'s update, as its read ``verdict`` tells,
        and mark its findings skipped, or applied; True for a skipped update."""
        if verdict is None:
            return False
        if step == self._deciding:  # judged before its update: a park may decide it yet
            self.verdicts[step] = verdict
            for old in list(self.verdicts)[:-KEPT]:
                self.verdicts.pop(old)
            return False
        mine = [a for a in anomalies if a.step == step and self._covers(a)]
        closed = [name for name, flag in verdict.items() if flag]
        if not closed:  # applied: a skip rule's finding the device did not see
            _applied([a for a in mine if a.rule in self.rules and not a.skipped], verdict, step)
            return False
        fresh = [a for a in mine if not a.skipped]
        if not fresh and (mine or NONFINITE in closed):
            return False  # skipped by the host already (before the update), or said by nobody
        how = _how(closed)
        for anomaly in fresh:
            anomaly.skipped = True
            anomaly.details["skipped"] = how
        unseen = "" if mine else "; the host's judgement, baselines moved since, finds it within"
        announce(f"step {step}: update skipped {how}{unseen}")
        return True

    def _covers(self, anomaly: Any) -> bool:
        return bool(anomaly.check == "nonfinite" or anomaly.rule in self.rules)


def _how(closed: list[str]) -> str:
    if NONFINITE in closed:
        return SKIPPED_ON_DEVICE
    rules = ", ".join(repr(name) for name in closed)
    return (
        f"on the device: the fused optimizer's found_inf (a gradient norm left the range "
        f"of rule {rules}, as its limits stood at the last read)"
    )


def _applied(anomalies: list[Any], verdict: dict[str, float], step: int) -> None:
    """Skip rules' findings whose update the device applied, and why."""
    for anomaly in anomalies:
        anomaly.details["applied"] = (
            "the update was applied: on the device the norm was within the rule's limits as "
            "they stood at the last read (the host's baselines moved since)"
            if anomaly.rule in verdict
            else "the update was applied: the device could not judge the rule at this step "
            "(the gradients are on several devices: each is judged on the host)"
        )
    if anomalies:  # one line a step (a rule's groups share the reason)
        first = anomalies[0]
        announce(f"step {step}: rule {first.rule!r}: {first.details['applied']}")


def _nonfinite_flag(grads: list[Entry]) -> Any:
    """1.0 on the first norm's device where any norm is NaN/Inf, else 0.0 (no host read)."""
    import torch

    norms = [e.vec for e in grads]
    flag = torch.logical_not(torch.isfinite(norms[0]).all()).float()
    for vec in norms[1:]:
        bad = torch.logical_not(torch.isfinite(vec).all()).float()
        flag = torch.maximum(flag, bad.to(flag.device, non_blocking=True))
    return flag
