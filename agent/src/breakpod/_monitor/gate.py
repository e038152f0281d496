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
"""

from __future__ import annotations

from typing import Any

from breakpod._core.announce import announce
from breakpod._core.config import env_flag
from breakpod._monitor.stats import StepRecord

SKIP_ON_DEVICE_ENV = "BREAKPOD_SKIP_ON_DEVICE"
SKIPPED_ON_DEVICE = "on the device: the fused optimizer's found_inf (its gradients were non-finite)"
KEPT = 64  # flags kept for steps not read yet (check_every is rarely larger)


def gate_for(optimizer: Any) -> UpdateGate | None:
    """A gate for ``optimizer`` when its step takes ``found_inf`` (a fused one), else None."""
    if optimizer is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    return UpdateGate(optimizer) if env_flag(SKIP_ON_DEVICE_ENV, True) else None


class UpdateGate:
    """Sets ``found_inf`` before each update it guards and takes it away after."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.flags: dict[int, Any] = {}  # step -> its device flag, until the step is read
        self._set = False  # found_inf is ours (to take away after the update)
        self._deciding: int | None = None  # a step judged before its update: a park may decide

    def close(self, record: StepRecord) -> None:
        """Before ``record``'s update, its gradients collected and not yet read: the fused
        kernel will skip the update if one of them is NaN/Inf."""
        if "found_inf" in vars(self.optimizer):
            return  # GradScaler's step set it: its verdict covers ours
        norms = [e.vec for e in record.entries if e.kind == "grads"]
        if not norms:
            return
        flag = _nonfinite_flag(norms)
        self.optimizer.found_inf = flag
        self._set = True
        self.flags[record.step] = flag
        self._deciding = record.step
        for step in list(self.flags)[:-KEPT]:
            self.flags.pop(step)

    def settle(self, step: int, parked: bool, anomalies: list[Any]) -> bool:
        """After the host judged ``step`` (or not) and before its update: a park decided
        the update (the gate opens), else its findings so far say the device skips it."""
        self._deciding = None
        if parked:
            self.flags.pop(step, None)
            self.after_update()
            return False
        return self.mark(step, anomalies)

    def after_update(self, *_: Any) -> None:
        """The optimizer's step post-hook: found_inf is the gate's for one step only."""
        if self._set:
            self._set = False
            vars(self.optimizer).pop("found_inf", None)

    def mark(self, step: int, anomalies: list[Any]) -> bool:
        """Mark ``step``'s non-finite findings as skipped if its gate closed on the
        device (reads the flag: only a step with a non-finite finding pays that)."""
        bad = [a for a in anomalies if a.check == "nonfinite" and a.step == step]
        flag = None if step == self._deciding else self.flags.get(step)
        if not bad or flag is None or not bool(flag):
            return False
        del self.flags[step]
        for anomaly in bad:
            anomaly.skipped = True
            anomaly.details["skipped"] = SKIPPED_ON_DEVICE
        announce(f"step {step}: update skipped {SKIPPED_ON_DEVICE}")
        return True


def _nonfinite_flag(norms: list[Any]) -> Any:
    """1.0 on the first norm's device where any norm is NaN/Inf, else 0.0 (no host read)."""
    import torch

    flag = torch.logical_not(torch.isfinite(norms[0]).all()).float()
    for vec in norms[1:]:
        bad = torch.logical_not(torch.isfinite(vec).all()).float()
        flag = flag + bad.to(flag.device, non_blocking=True)
    return flag
