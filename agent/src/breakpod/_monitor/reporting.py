"""A monitor's reporting: anomalies handed to their rules' actions, and its own
failures contained (said once, counted, never raised into training but by ``stop``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.compiling import compiling_check
from breakpod._core.errors import AnomalyError
from breakpod._monitor.anomaly import Anomaly, dispatch, merge_same_tensor
from breakpod._monitor.rules import Rule
from breakpod._monitor.state import MonitorState
from breakpod._monitor.stats import StepRecord
from breakpod._monitor.timetravel.capture import as_own, replaying


class Reporting(MonitorState):
    """Anomalies to their actions, failures contained, the monitor's one-line summary."""

    def _report(self, found: list[tuple[Anomaly, Rule]], frame: FrameType | None = None) -> None:
        merged = merge_same_tensor(found)
        self.anomalies.extend(a for a, _ in merged)
        self._ctx.frame = frame
        try:
            for anomaly, actions in merged:
                dispatch(anomaly, actions, self._ctx)
                anomaly.tensor = None  # the actions had it; the anomaly list keeps no tensors
        finally:
            self._ctx.frame = None

    @contextlib.contextmanager
    def _contained(self, where: str) -> Iterator[None]:
        """A failure inside is the monitor's, reported once, never the training loop's;
        only ``stop`` raises. (The hooks inline the same, being on the hot path.)
        Tensors made inside are normal ones even when the loop calls ``step()`` inside
        ``torch.inference_mode()``: an inference tensor could never be written again."""
        try:
            with sys.modules["torch"].inference_mode(False):
                yield
        except AnomalyError:
            raise
        except Exception as e:
            self._fail(where, e)

    @property
    def errors(self) -> int:
        """Failures inside the monitor (its hooks, step ends, reads) and its rules'
        actions: each kind is said once, and the job continues."""
        return self._errors + self._ctx.errors

    def _fail(self, where: str, error: Exception) -> None:
        self._errors += 1
        if where not in self._failed:
            self._failed.add(where)
            announce(f"monitor {where} failed ({type(error).__name__}: {error}); the job continues")

    def _guarded(self, where: str, fn: Callable[..., None]) -> Callable[..., None]:
        """Wrap a hook: a failure is reported once and swallowed; only ``stop`` raises."""

        compiling = compiling_check()

        def hook(*args: Any) -> None:
            if compiling():  # dynamo would trace the hook's tensor marks and fail: skip it
                return
            # timetravel: a replayed step is not a new step (but a probe's, see sentinel.py,
            # whose ops are its own: the replay's op check looks past them)
            replay = replaying()
            if replay and not self._sees_replay:
                return
            try:
                if replay:
                    as_own(fn, *args)
                else:
                    fn(*args)
            except AnomalyError:
                raise
            except Exception as e:
                self._fail(where, e)

        return hook

    def _say_if_compiled(self, done: StepRecord) -> None:
        """Gradients but no module stats: the model ran compiled, where hooks do not run."""
        kinds = {e.kind for e in done.entries}
        if self._said_compiled or not self._module_checks or "grads" not in kinds:
            return
        if done.ran:
            return
        self._said_compiled = True
        announce(
            "monitor: the model ran under torch.compile or a torch.func transform (vmap, "
            "grad, jacrev), where breakpod's module hooks do not run; only gradient norms, "
            "parameters and the loss are checked (blamed on the parameter's module). For "
            "per-module checks under torch.compile set BREAKPOD_DISABLE_COMPILE=1"
        )

    def summary_line(self) -> str:
        """``breakpod.summary(monitor)``: the counts, then as many rule names as fit in about
        120 characters, never cutting a count (``+3 more`` says how many are left out)."""
        state = "on" if self.enabled else "off"
        line = (
            f"monitor {state}: step {self.step_count}, {len(self.anomalies)} anomalies, "
            f"{self.skipped_steps} skipped steps, {self.errors} errors; {len(self.rules)} rules: "
        )
        names = [r.name for r in self.rules]
        for shown in range(len(names), 0, -1):
            more = f" +{len(names) - shown} more" if shown < len(names) else ""
            listed = line + ", ".join(names[:shown]) + more
            if len(listed) <= 120:
                return listed
        return line + f"+{len(names)} more" if names else line.rstrip(": ")

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return (
            f"<breakpod.Monitor {state} rules={[r.name for r in self.rules]} "
            f"step={self.step_count} check_every={self.check_every} "
            f"anomalies={len(self.anomalies)} skipped_steps={self.skipped_steps}>"
        )
