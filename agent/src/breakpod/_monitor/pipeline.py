"""A monitor's step pipeline: the loss recorded, the step ended (its statistics
snapshotted, the flight recorder's row), the pending steps read to the host every
``check_every`` steps (or at once when a rule must answer before the update), judged
there, and a bad step's update skipped."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from breakpod._core import events
from breakpod._core.announce import announce
from breakpod._job import boundary
from breakpod._monitor import checks
from breakpod._monitor.anomaly import Anomaly
from breakpod._monitor.anomaly import user_frame as _user_frame
from breakpod._monitor.detect import StepData
from breakpod._monitor.hooks import ModuleHooks
from breakpod._monitor.peers import (
    Departure,
    Peers,
    departures_at,
    drop_update,
    follow,
    peers_of,
)
from breakpod._monitor.stats import (
    Entry,
    StepRecord,
    copy_events,
    decode,
    landed,
    pack,
    to_host,
)

JUDGE_LABEL = "breakpod.judge"  # the host-side judgement, as profiler traces name it


class StepPipeline(ModuleHooks):
    """The step's end, the host reads and the judgement; ``step``, ``record_loss``, ``flush``."""

    def record_loss(self, loss: Any) -> None:
        """Check this step's loss: the step being trained, or, with ``optimizer=`` after
        ``optimizer.step()`` and before the next pass, the step that update ended."""
        if not self.enabled:
            return
        if self._updated:
            self._late_loss(loss)
        else:
            self._put_loss(loss)

    def _put_loss(self, loss: Any) -> None:
        import torch

        try:
            value = torch.as_tensor(loss).detach()
        except (TypeError, ValueError, RuntimeError):
            if not self._said_bad_loss:
                self._said_bad_loss = True
                announce(
                    f"monitor: the loss passed to monitor.step() is a {type(loss).__name__}; "
                    "expected a tensor or a number (the loss itself, e.g. outputs['loss']): "
                    "it is not checked"
                )
            return
        if not value.numel():
            return  # an empty batch's loss: no value to check
        value = checks.as_float32(value).float()
        value = value.reshape(1) if value.numel() == 1 else value.mean().reshape(1)
        self._current.entries = [e for e in self._current.entries if e.kind != "loss"]
        kept = loss.detach() if isinstance(loss, torch.Tensor) else value
        self._current.entries.append(Entry("loss", value, tensor=kept))

    def step(self, loss: Any = None) -> None:
        """End a training step: stats are packed, and read every ``check_every`` steps.

        With ``optimizer=`` the optimizer's step ends steps; this then only
        records ``loss`` (for the step the optimizer ended, when called after it).
        """
        if self._departures is not None and self._departures.owed and self._optimizer is None:
            self._departures()  # closed monitors' last agreements first, as with an optimizer
        if not self.enabled:
            return
        frame = _user_frame(sys._getframe(1))
        with self._contained("step boundary"):
            if self._handles_steps():
                self._end_step(loss, frame)
            elif loss is not None:
                self.record_loss(loss)
        boundary.boundary(self.step_count, frame)  # `breakpod send ID break` parks here

    def _handles_steps(self) -> bool:
        return self._optimizer is None

    def _before_update(self, optimizer: Any, *_: Any) -> None:
        """The optimizer's step pre-hook ends the step: checks run before the update."""
        frame = _user_frame(sys._getframe())
        record = self._current  # the step that ends here
        self._end_step(None, frame)
        if self._gate is not None:  # a park decided the update; else the device does
            parked = self._ctx.parked_step == record.step
            if self._gate.settle(record.step, parked, self.anomalies[-8:]):
                self.skipped_steps += 1
        self._updated = True
        boundary.boundary(self.step_count, frame, now=True)  # a `break`: before the update

    def _end_skipped_step(self) -> None:
        """End the step whose update the loop skipped, as the optimizer's step would have:
        it is judged as any step. The forward captured since is the new step's."""
        skipped = self._current.step
        self._loop_skipped = True  # no update to drop, or agree on (_apply_skip)
        try:
            self._end_step(None)
        finally:
            self._loop_skipped = False
        if self._gate is not None:  # its found_inf is for an update that never comes
            self._gate.after_update()
        last = self.capture.last if self.capture is not None else None
        if last is not None and last.step == skipped:
            last.step, last.forwards = self.step_count, 1

    def _end_step(self, loss: Any, frame: FrameType | None = None) -> None:
        step, decided = self._current.step, self._decided
        try:
            self._finish_step(loss, frame)
        finally:  # whatever failed: the step ends (numbered as on the other ranks), a
            # skip decided stands, and the peers wait for this rank's verdict
            if self.step_count == step:
                self._current, self.step_count = self._record(step + 1), step + 1
            if self._urgent and self._decided == decided:
                self._apply_skip(step)

    def _finish_step(self, loss: Any, frame: FrameType | None = None) -> None:
        self._root.settle()  # a model compiled since: its root hooks leave the graph
        if loss is not None:
            self._put_loss(loss)
        if not self._current.grads_done and self._params:
            self._collect_grads()  # no backward ran through the model's output hook
        if self._gate is not None:  # the optimizer's pre-hook ends a step: an update follows
            self._gate.close(self._current)
        done, self._current = self._current, self._record(self.step_count + 1)
        self._ignore_pass = False
        self._stager.end_step()
        self._table.snapshot(done)
        if self.flight is not None:
            self.flight.record(done, self._table)
        self.step_count += 1
        self._pending.append(done)
        self._say_if_compiled(done)
        if self._urgent:  # a break/stop/skip rule needs the verdict before the update
            self._read(done)
            self._evaluate_landed(wait=True, frame=frame)
            self._apply_skip(done.step)
        elif self.step_count % self.check_every == 0 or done.kept or done.read_now:
            self._read(done)  # kept tensors (break/snapshot rules) live one step, not check_every
        self._evaluate_landed(wait=False)

    def _record(self, step: int) -> StepRecord:
        """A new step's record. Activation statistics (mean |x|, dead units) are slow
        conditions: they are measured on the steps that end with a read, every
        ``check_every``; non-finite values, on every step."""
        return StepRecord(step, stats=(step + 1) % self.check_every == 0)

    def _late_loss(self, loss: Any) -> None:
        """``monitor.step(loss)`` after ``opt.step()``: the loss of the step that just ended.

        Its update is applied already, so it waits for the next read (no extra one).
        """
        late, self._current = self._current, StepRecord(self.step_count - 1, partial=True)
        self._put_loss(loss)
        self._current, record = late, self._current
        if not record.entries:  # no value to check (an empty or a wrongly typed loss)
            return
        if self.flight is not None:
            self.flight.record_loss(record.entries[-1].vec)
        self._pending.append(record)

    def _apply_skip(self, step: int) -> None:
        """Drop this step's update: no gradient, so the optimizer's step changes nothing.
        Agreed with the peers (peers.py): if one rank drops it, every rank does."""
        skip = self._ctx.take_skip(step)
        self._decided += 1
        if self._loop_skipped:  # the loop applied no update: nothing to drop, or agree on
            if skip:  # (the gradients by now are the next step's)
                self._mark_step_skipped(step)
            return
        if self._peers is not None:
            agreed = self._peers.agree(skip, step)
            if agreed and not skip:
                follow(step)
            skip = agreed
        if not skip:
            return
        if any(p._version != version for p, version in self._probe):
            announce(
                f"step {step}: update not skipped: optimizer.step() ran before monitor.step(), "
                "so it was applied before the verdict (call monitor.step(loss) before "
                "optimizer.step(), or pass watch(optimizer=...))"
            )
            return
        drop_update(self._optimizer, self.model)
        self.skipped_steps += 1
        self._mark_step_skipped(step)
        announce(f"step {step}: update skipped (gradients dropped before the optimizer step)")

    def _mark_step_skipped(self, step: int) -> None:
        for anomaly in self.anomalies:
            if anomaly.step == step:
                anomaly.skipped = True

    def _leave_peers_later(self) -> None:
        """close() with peers that agree each update's skip with this rank: they make their
        next agreement with it, so this rank makes it too, and leaves there (peers.py)."""
        if self._peers is None or not self._peers.owed or self._peers.leaving:
            return
        departure = Departure(self._peers, self.step_count, self._optimizer, self.model)
        departures_at(self.model if self._optimizer is None else self._optimizer).owed.append(
            departure
        )

    def _can_skip(self) -> bool:
        """Can this monitor skip an update (a ``skip`` or ``break`` rule, judged before it)?"""
        acts = {a for r in self.rules for a in r.actions}
        return not self._is_probe and self._urgent and bool(acts & {"skip", "break"})

    def _skip_peers(self) -> Peers | None:
        """The ranks that must skip with this one, if it can skip an update, in a
        data-parallel job of several."""
        if not self._can_skip():
            return None
        return peers_of(self.model, [p for _, p in self._params])

    def flush(self) -> list[Anomaly]:
        """Read and evaluate everything now (a host sync); returns the new anomalies."""
        if not self.enabled:
            return []
        before = len(self.anomalies)
        with self._contained("flush"):
            if self._pending:
                self._read(self._pending[-1])
            self._evaluate_landed(wait=True)
        return self.anomalies[before:]

    def _read(self, last: StepRecord, *, state: bool = True) -> None:
        """Start the host copy of every pending step (with the state checks on ``last``)."""
        if state:
            self._add_state_checks(last)
        steps, self._pending = self._pending, []
        copies = {
            device: to_host(t, self._host_buffers)
            for device, t in pack([e for s in steps for e in s.entries]).items()
        }
        self._inflight.append((copy_events(copies), copies, steps))
        self.reads += 1

    def _evaluate_landed(self, *, wait: bool, frame: FrameType | None = None) -> None:
        while self._inflight:
            marks, copies, steps = self._inflight[0]
            if not landed(marks, wait=wait):
                return  # not landed yet: the next boundary looks again
            self._inflight.pop(0)
            try:
                self._evaluate(copies, steps, frame)
            finally:  # landed and read: the buffers may take the next copies
                for host in copies.values():
                    self._host_buffers.give_back(host)

    def _evaluate(
        self, copies: dict[Any, Any], steps: list[StepRecord], frame: FrameType | None
    ) -> None:
        import torch
        from torch.autograd.profiler import record_function

        if not torch._C._autograd._profiler_enabled():  # (a label costs 7 µs unprofiled)
            self._judge(copies, steps, frame)
            return
        # named in profiler traces: on a healthy step its torch ops all run on host copies,
        # none on the device (the bench's kernel-launch count leaves them out by this name)
        with record_function(JUDGE_LABEL):
            self._judge(copies, steps, frame)

    def _judge(
        self, copies: dict[Any, Any], steps: list[StepRecord], frame: FrameType | None
    ) -> None:
        values = {device: host.tolist() for device, host in copies.items()}
        for i, step in enumerate(steps):
            data = decode(step, values, copies)
            self._table.expand(data, self._detector.hot_modules())
            # exporters (breakpod.export): host floats already read, before a stop can raise;
            # a probe's replayed step is no training step
            if not self._is_probe:
                events.emit_local(
                    events.STEP_STATS,
                    monitor=self,
                    steps=[data],
                    params=self._detector.params,
                    read_done=i == len(steps) - 1,
                )
            found = self._detector.run(data)
            if not self._is_probe:  # a GradScaler's overflow is held, not reported
                found = self._scaling.sift(
                    found, data, self._detector.ongoing, self._outputs_finite
                )
            self._mark_skipped(data, [a for a, _ in found])
            self._report(found, frame)

    def _outputs_finite(self, step: int) -> bool:
        """Were the model's outputs finite in ``step`` (as far as the capture tells)?"""
        last = self.capture.last if self.capture is not None else None
        if last is None or last.step != step:
            return True
        return all(bool(finite) for finite in last.finite)

    def _mark_skipped(self, data: StepData, anomalies: list[Anomaly]) -> None:
        if self._gate is not None and self._gate.mark(data.step, anomalies, data.gate):
            self.skipped_steps += 1
