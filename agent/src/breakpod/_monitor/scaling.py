"""Loss scaling's overflows, told from NaN/Inf that would reach the weights.

Under ``torch.amp.GradScaler`` (fp16 mixed precision) gradients that overflow are
the scaler's business: it finds them itself, skips the update and halves its
scale, a few times at the start of a run and now and then after. Reported as
anomalies, they would alarm (and in debug mode park) healthy runs at their first
steps. So a step whose gradients are non-finite while the model's outputs and
loss are finite, with a scaler that scaled the step, is an overflow: said in one
line and held, not reported. A NaN the scaling does not explain (one the backward
makes whatever the scale) shows as overflows that do not stop: after
:data:`IN_A_ROW` steps in a row (the default scale of 2**16 halved down to 1) the
held finding is reported, with what the scaler did meanwhile.

The scaler is found by looking through the live objects once, when a first
gradient goes non-finite (a collection of the garbage first, then 40 ms of looking
in a process with transformers loaded), and kept by a weak reference.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

from breakpod._core.announce import announce
from breakpod._monitor.detect import Found, StepData

IN_A_ROW = 16  # overflowing steps in a row that the scaling no longer explains


class LossScaling:
    """A monitor's view of the job's GradScaler, if it has one."""

    def __init__(self) -> None:
        self._scaler: weakref.ref[Any] | None = None
        self._looked = False  # the live objects were searched (a job without a scaler: once)
        self._held: list[Found] = []  # the overflow's first findings, while it lasts
        self._in_a_row = 0
        self._scale_at_start = 0.0
        self._overflows = 0  # overflows held: a long run's are routine, said ever more rarely

    def scaling(self) -> Any:
        """The job's GradScaler, enabled and scaling, or ``None``."""
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None and not self._looked:
            self._looked = True
            scaler = _find_scaler()
            self._scaler = weakref.ref(scaler) if scaler is not None else None
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return None
        return scaler

    def updates(self) -> int | None:
        """How many times the known scaler's ``update()`` ran, as its scale tensor's version
        counter tells (no host read; no search for a scaler not found yet)."""
        scaler = self._scaler() if self._scaler is not None else None
        scale = getattr(scaler, "_scale", None)
        return None if scale is None else int(scale._version)

    def sift(
        self,
        found: list[Found],
        data: StepData,
        ongoing: Callable[[str], bool],
        outputs_finite: Callable[[int], bool],
    ) -> list[Found]:
        """``found`` less an overflow's findings, held while the overflow lasts; the held
        ones come back once it has lasted :data:`IN_A_ROW` steps, or the loss goes
        non-finite. ``ongoing(rule)``: the detector's outbreak of that rule goes on."""
        if self._held:
            return self._go_on(found, data, ongoing)
        gradients = [f for f in found if f[1].check == "nonfinite"]
        if not gradients or not all(a.phase == "backward" for a, _ in gradients):
            return found  # none, or NaN/Inf outside the gradients too: the model's
        if not _finite(data.loss) or not outputs_finite(data.step):
            return found
        scaler = self.scaling()
        if scaler is None:
            return found
        self._held, self._in_a_row = gradients, 1
        self._scale_at_start = float(scaler.get_scale())
        self._overflows += 1
        if self._overflows & (self._overflows - 1) == 0:  # the 1st, 2nd, 4th, 8th...
            count = f", the {_nth(self._overflows)} so far" if self._overflows > 1 else ""
            announce(
                f"monitor: step {data.step}: GradScaler overflow{count} (NaN/Inf in the scaled "
                f"gradients, the model's outputs finite): the scaler skips the update and "
                f"lowers its scale ({self._scale_at_start:g}); not an anomaly, unless it "
                f"lasts {IN_A_ROW} steps"
            )
        return [f for f in found if f[1].check != "nonfinite"]

    def _go_on(
        self, found: list[Found], data: StepData, ongoing: Callable[[str], bool]
    ) -> list[Found]:
        if data.partial and _finite(data.loss):
            return found  # a loss given after the update: no step of its own
        if not data.partial:
            if not any(ongoing(rule.name) for _, rule in self._held):  # the scaler got past it
                self._held, self._in_a_row = [], 0
                return found
            self._in_a_row += 1
        if self._in_a_row < IN_A_ROW and _finite(data.loss):
            return found
        held, self._held = self._held, []
        scaler = self.scaling()
        scale = float(scaler.get_scale()) if scaler is not None else math.nan
        why = (
            f"the loss went non-finite at step {data.step}"
            if not _finite(data.loss)
            else f"the gradients stayed non-finite for {self._in_a_row} steps whatever the scale"
        )
        for anomaly, _ in held:
            anomaly.details["loss_scaling"] = (
                f"held as a GradScaler overflow from step {anomaly.step} (scale "
                f"{self._scale_at_start:g}, now {scale:g}) until {why}: not an overflow"
            )
        self._in_a_row = 0
        return held + found


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _finite(loss: float | None) -> bool:
    return loss is None or math.isfinite(loss)


def _find_scaler() -> Any:
    import gc

    from torch.amp import GradScaler

    gc.collect()  # a scaler that is garbage (a finished loop's, in a cycle) is no scaler
    for candidate in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some objects warn on
        if issubclass(type(candidate), GradScaler) and candidate.is_enabled():
            return candidate
    return None
