"""The sentinel tier's localization: a non-finite value that the step's loss or
gradient norms show is traced to the module that made it, by replaying the step.

The sentinel hooks no module, so what it finds is where a NaN ended up (the
loss, a parameter's gradient), not where it was born. At the step's end, before
the update (the optimizer's pre-hook; a parked job waits there), a non-finite
finding replays the captured step (:mod:`~breakpod._monitor.timetravel.replay`)
under a *probe*: a detailed copy of the monitor, its hooks on every module for
the duration of the replay only, reporting to this monitor instead of acting.
What the probe finds is what the detailed tier would have reported live (the
same rule, module, phase and summary); the op that made the value comes from
the replay's dispatch check. The anomaly says which tier found it and how
(``tier``, ``how``: ``live`` or ``replay``).

A replay that does not reproduce the step (its gradients differ: a
non-deterministic op, data-dependent randomness), or a step no longer captured
(read ``check_every`` steps later), is said so and turns the detailed tier on
for the next ``BREAKPOD_DETAILED_STEPS`` steps: the probe then runs live, so the
next occurrence is localized as it happens.

On a CPU, where reading the norms costs no device sync, the end of each
backward looks at them, and a non-finite one replays its step right there: the
weights, the inputs and the state around the model are still the step's (the
update, or a loop that switches its fault off, come later), and the step is read
at its end whatever ``check_every`` is. On a GPU the step's end is where the
sentinel reads (with ``watch(optimizer=...)`` before the update); a step read
later, or after its update, may not reproduce, and the detailed tier takes over.
"""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any

from breakpod._core.announce import announce
from breakpod._monitor.anomaly import Anomaly
from breakpod._monitor.params import norms_finite
from breakpod._monitor.peers import VIA_ALL_REDUCE, several_ranks
from breakpod._monitor.pipeline import StepPipeline
from breakpod._monitor.rules import Rule
from breakpod._monitor.stats import StepRecord
from breakpod._monitor.tiers import DETAILED, SENTINEL, detailed_steps

Found = tuple[Anomaly, Rule]
BEFORE_LOSS = ("input", "forward")  # a probe's sites that come before the loss in a step
FROM_ANOTHER_RANK = f"not localized on this rank: its own step replayed finite, so {VIA_ALL_REDUCE}"

NOT_REPLAYED_SHARDED = (
    "the model is under FSDP, so its step is not replayed: its forward gathers parameters "
    "from the other ranks and its backward reduces gradients with them, which would wait "
    "for a replay of their own"
)


class Sentinel(StepPipeline):
    """A sentinel monitor's findings localized by replay; a probe's kept for its parent."""

    def _start_sentinel(self) -> None:
        self._found: list[Found] = []  # a probe's findings, for its parent
        # a step localized at the end of its backward (CPU): step -> its findings, and how
        self._early: dict[int, tuple[dict[str, Found], str]] = {}
        self._bad_step = -2  # the last step whose gradients were seen non-finite (CPU)
        # ((step, forwards), gradient norms) at the end of the last two backwards: no copy,
        # read at a trigger only (a host read there on a GPU), for gradient accumulation
        self._backward_norms: list[tuple[tuple[int, int], list[Any]]] = []
        self._live: Any = None  # a probe: the detailed tier, live after a failed replay
        self._live_until = 0
        self.replay_seconds: list[float] = []  # each localizing replay's time (the bench reads it)

    def _close_sentinel(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None
        self._early.clear()

    # -- reporting: localize first
    def _report(self, found: list[Found], frame: FrameType | None = None) -> None:
        if self._is_probe:
            self._found.extend(found)
            return
        if self.tier == SENTINEL and any(r.check == "nonfinite" for _, r in found):
            found = self._localized(found)
        for anomaly, _ in found:
            anomaly.tier = anomaly.tier or self.tier
        super()._report(found, frame)

    def _localized(self, found: list[Found]) -> list[Found]:
        step = next(a.step for a, r in found if r.check == "nonfinite")
        better, note = self._localization(step)
        out = [
            (self._choose(a, better.pop(r.name)[0] if r.name in better else None, note), r)
            if r.check == "nonfinite"
            else (a, r)
            for a, r in found
        ]
        # a rule the sentinel cannot see (its modules have no parameters): the probe's site
        return out + list(better.values())

    @staticmethod
    def _choose(live: Anomaly, localized: Anomaly | None, note: str) -> Anomaly:
        """The detailed tier's site, in its order: the batch and module outputs come
        before the loss, the loss before the gradients."""
        if localized is not None and (localized.phase in BEFORE_LOSS or live.phase != "loss"):
            localized.details.setdefault("localized", note)
            if live.skipped:  # on the device (gate.py): the step's fate, whoever names it
                localized.skipped = True
                localized.details["skipped"] = live.details.get("skipped")
            return localized
        live.details["localized"] = note
        live.tier = SENTINEL
        return live

    def _localization(self, step: int) -> tuple[dict[str, Found], str]:
        """Per rule, the first site the detailed checks find in ``step``, and how."""
        if step in self._early:
            return self._early.pop(step)
        if self._live is not None:
            return self._live_findings(step), "found live by the detailed tier"
        capture = self.capture
        if capture is None:
            return {}, "not localized: replay capture is off (replay=False or BREAKPOD_REPLAY=0)"
        if capture.last is None or capture.last.step != step:
            why = f"step {step} is no longer captured: it was read at step {self.step_count - 1}"
            self._escalate(step, why)
            return {}, f"not localized: {why}"
        return self._replayed(step)

    def _replayed(self, step: int) -> tuple[dict[str, Found], str]:
        from breakpod._monitor.timetravel import replay

        capture = self.capture
        if capture is None or capture.last is None:
            return {}, "not localized: no step captured"
        if self._sharded:
            self._escalate(step, NOT_REPLAYED_SHARDED)
            return {}, f"not localized: {NOT_REPLAYED_SHARDED}"
        started = time.perf_counter()
        probe = self._new_probe(step)
        probe.ops_are_own()
        try:
            report = replay.replay(self.model, capture)
            found = probe.finish_probe()
        except Exception as e:  # a replay that fails says so; the finding stays the sentinel's
            self._escalate(step, f"the replay failed ({type(e).__name__}: {e})")
            return {}, f"not localized: the replay failed ({type(e).__name__}: {e})"
        finally:
            self.shapes.update(probe.shapes)  # for tshape at the park
            probe.close()
        seconds = time.perf_counter() - started
        self.replay_seconds.append(seconds)
        last = capture.last
        if not found and report.first is None and _outputs_were_finite(last):
            # the replayed forward was finite, and so was the step's own: the NaN/Inf came
            # from elsewhere (a step whose outputs were not finite did not reproduce: below)
            averaged = _averaged(self.model, last)
            if last.forwards > 1 and not self._finite_before(step, last.forwards):
                why = _earlier_forward(last.forwards, averaged)
                self._escalate(step, why)
                return {}, f"not localized: {why}"
            if averaged:
                announce(f"monitor: step {step}'s non-finite value was {FROM_ANOTHER_RANK}")
                return {}, FROM_ANOTHER_RANK  # that rank's own replay names the module
        why_not = _not_reproduced(report, found, last)
        if why_not:
            self._escalate(step, f"its replay did not reproduce it ({why_not})")
            return {}, f"not localized: the replay did not reproduce the step ({why_not})"
        note = f"replayed in {seconds:.3f} s ({report.ops} ops), {_verdict(report)}"
        bad = report.first or report.first_any
        first: dict[str, Found] = {}
        for anomaly, rule in found:
            if rule.name not in first:
                anomaly.tier, anomaly.how = SENTINEL, "replay"
                if bad is not None:
                    anomaly.details["op"] = bad.where()
                first[rule.name] = (anomaly, rule)
        return first, note

    def _new_probe(self, step: int) -> Any:
        """A detailed monitor of the same model and non-finite rules, for one step."""
        rules = [r for r in self.rules if r.check == "nonfinite"]
        make: Any = type(self)  # the Monitor, whose constructor installs the hooks
        probe = make(self.model, rules, check_every=1, tier=DETAILED, probe=True)
        probe.step_count, probe._current = step, probe._record(step)
        probe._said_compiled = True  # its hooks run in the replay, which runs eagerly
        return probe

    def finish_probe(self) -> list[Found]:
        """End the probe's one step and judge it now; its findings."""
        self._end_step(None)
        self.flush()
        found, self._found = self._found, []
        return found

    # -- at the end of a backward
    def _backward_done(self) -> None:
        """On a CPU, where reading the gradient norms costs no device sync, a non-finite one
        is seen at the end of its backward, and its step replayed there: the weights,
        the captured inputs and the state around the model are still the step's (the
        update, or a loop that switches its fault off, come later). The step is then read
        at its end, not ``check_every`` steps later."""
        if self.capture is None or self._is_probe or self._live is not None:
            return  # (with the detailed tier live, it sees the step as it runs)
        if self.tier != SENTINEL:
            return  # the detailed tier's own hooks localize it as it runs: no replay
        norms = self._grad_vectors()
        step, last = self._current.step, self.capture.last
        if norms and last is not None and last.step == step:
            self._backward_norms = [*self._backward_norms[-1:], ((step, last.forwards), norms)]
        if not norms or any(v.device.type != "cpu" for v in norms):
            return
        if norms_finite(norms):
            return
        ongoing = self._bad_step in (step - 1, step)  # an outbreak reported already
        self._bad_step = step
        if ongoing or self._overflow(step):
            return
        self._current.read_now = True
        if step not in self._early and last is not None and last.step == step:
            self._early = {step: self._replayed(step)}  # the latest step only

    def _finite_before(self, step: int, forwards: int) -> bool:
        """Were the step's gradients finite at the end of its next-to-last forward's
        backward? Then an earlier forward did not make the NaN (gradient accumulation)."""
        earlier = [norms for key, norms in self._backward_norms if key == (step, forwards - 1)]
        return bool(earlier) and norms_finite(earlier[0])

    def _overflow(self, step: int) -> bool:
        """Most likely a GradScaler's overflow, which the judgement holds (scaling.py): the
        model's outputs finite, a scaler scaling. Not replayed now: the replay would
        report it."""
        return self._outputs_finite(step) and self._scaling.scaling() is not None

    # -- the detailed tier, live for a while
    def _escalate(self, step: int, why: str) -> None:
        steps = detailed_steps()
        if steps == 0 or self._is_probe or not self.enabled:
            return
        announce(
            f"monitor: step {step}'s non-finite value was not localized: {why}; the detailed "
            f"tier is on for the next {steps} steps, so the next one is localized as it happens"
        )
        if self._live is None:
            self._live = self._new_probe(self.step_count)
            self._live._sees_replay = False  # live: it checks training steps, not replays
        self._live_until = self.step_count + steps

    def _unreplayable(self, done: StepRecord) -> str:
        """Why the sentinel cannot serve this model, or ``""``: a step with gradients and no
        capture (the root's forward never ran), or one without gradients (inference)."""
        if self.tier != SENTINEL or self._is_probe or self.capture is None:
            return ""
        grads = any(e.kind == "grads" for e in done.entries)
        if grads and self.capture.redirected:
            return (
                "the watched model's forward was patched during its own call in the step, which "
                "leaves a replay nothing to call"
            )
        if grads and self.capture.last is None and not self._root.give_a_step():
            return (  # (compiled, its hooks leave the graph: it is captured from its next step)
                "the watched model's own forward was not seen in a training step (its modules "
                "were called directly, as a LightningModule's training_step calls its networks, "
                "or it runs inside a function compiled by torch.compile)"
            )
        if not grads and self.capture.last is not None and not done.partial:
            return "a step ended without gradients (an inference job: the sentinel reads gradients)"
        return ""

    def _live_findings(self, step: int) -> dict[str, Found]:
        live = self._live
        first: dict[str, Found] = {}
        if live is None:
            return first
        for anomaly, rule in live._found:
            if anomaly.step == step and rule.name not in first:
                anomaly.tier, anomaly.how = DETAILED, "live"
                first[rule.name] = (anomaly, rule)
        live._found = [(a, r) for a, r in live._found if a.step > step]
        return first

    def _finish_step(self, loss: Any, frame: FrameType | None = None) -> None:
        live = self._live
        if live is not None:  # its step first, so that this step's judgement has it
            live._end_step(None)
            live.flush()
        done = self._current
        super()._finish_step(loss, frame)
        if live is not None and live._found:  # what only the detailed tier saw (no trigger)
            said = {(a.step, a.rule) for a in self.anomalies}
            left = [
                (a, r)
                for a, r in live._found
                if a.step < self.step_count
                and (a.step, a.rule) not in said
                and not self._detector.ongoing(a.rule)  # its outbreak: reported already
            ]
            live._found = [(a, r) for a, r in live._found if a.step >= self.step_count]
            for anomaly, _ in left:
                anomaly.tier, anomaly.how = DETAILED, "live"
            super()._report(left, frame)
        why = self._unreplayable(done) if live is None else ""
        if why:
            announce(f"monitor: {why}, so no step can be replayed: the detailed tier is on")
            self._live = self._new_probe(self.step_count)
            self._live._sees_replay = False
            self._live_until = sys.maxsize
        if live is not None and self.step_count >= self._live_until:
            live.close()
            self._live = None
            announce(f"monitor: the detailed tier is off again after step {self.step_count - 1}")


def _averaged(model: Any, captured: Any) -> bool:
    """Were the step's gradients averaged over ranks (DDP in a job of several)? The model
    is DDP, or the module DDP holds (the capture saw its forward run inside DDP's)."""
    import torch

    ddp = captured.averaged or isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return ddp and several_ranks()


def _outputs_were_finite(captured: Any) -> bool:
    """Were the captured forward's outputs finite in the step itself? (A host read of its
    0-d flags: at an anomaly only.)"""
    return all(bool(f) for f in captured.finite)


def _earlier_forward(forwards: int, averaged: bool) -> str:
    another = ", or through DDP's all-reduce from another rank" if averaged else ""
    return (
        f"its last forward replayed finite, and the step ran {forwards} forwards (only the "
        f"last is captured): the NaN/Inf came from an earlier one{another}"
    )


def _verdict(report: Any) -> str:
    if report.reproduced:
        return "reproduced bit-exactly"
    if report.same_nonfinite:
        return "its NaN/Inf reproduced in the same places (finite values differ)"
    return f"not compared: {report.why_not}"


def _not_reproduced(report: Any, found: list[Found], captured: Any) -> str:
    """Why the replay is not the step, or ``""``: its gradients differ (beyond where the
    NaN/Inf are), or its outputs are finite where the real ones were not (the replay's
    NaN then only came back through the captured output gradient)."""
    if report.reproduced is False and not report.same_nonfinite:
        return str(report.why_not)
    # the probe's sites before the loss (a non-finite parameter makes the outputs so too)
    forward_bad = any(a.phase in (*BEFORE_LOSS, "param") for a, _ in found)
    if not forward_bad and not _outputs_were_finite(captured):
        return "the model's outputs were non-finite in the step and finite in its replay"
    return ""
