"""Anomaly records and the actions a rule takes on them.

Actions: ``log`` (a line on stderr), ``event`` (``events.emit("anomaly",
...)`` plus the monitor's own sink), ``break`` (park in a debugger in a
frame that holds the anomaly), ``snapshot`` (``torch.save`` the offending
tensor and stats), ``stop`` (raise :class:`~breakpod.errors.AnomalyError`),
or any callable taking the :class:`Anomaly`. Only ``stop`` may raise into
the training loop; every other failure is reported once and swallowed.
"""

from __future__ import annotations

import dataclasses
import linecache
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from breakpod import events
from breakpod.announce import announce
from breakpod.errors import AnomalyError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Anomaly:
    """One detection: which rule, where (module path, phase), when (step), what."""

    rule: str
    check: str
    module: str
    step: int
    phase: str
    summary: str
    value: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The offending tensor (detached), while the actions run; the monitor then drops it.
    tensor: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        where = self.module or "<model>"
        return f"step {self.step} {self.phase} {where}: [{self.rule}] {self.summary}"

    def to_dict(self) -> dict[str, Any]:
        """Plain fields for events and snapshots (no tensor)."""
        fields = dataclasses.asdict(dataclasses.replace(self, tensor=None))
        fields.pop("tensor")
        return fields


@dataclasses.dataclass
class ActionContext:
    """What actions need from the monitor."""

    model: Any
    snapshot_dir: Path
    sink: Callable[[Anomaly], Any] | None = None
    monitor: Any = None
    failed: set[str] = dataclasses.field(default_factory=set)


def dispatch(anomaly: Anomaly, actions: tuple[Any, ...], ctx: ActionContext) -> None:
    """Run each action; ``stop`` runs last so the others still happen."""
    for action in actions:
        if action == "stop":
            continue
        try:
            _ACTIONS[action](anomaly, ctx) if isinstance(action, str) else action(anomaly)
        except Exception as e:  # a failing action never takes the job down
            _report_once(ctx, str(action), e)
    if "stop" in actions:
        announce(f"stopping: {anomaly}")
        raise AnomalyError(anomaly)


def _report_once(ctx: ActionContext, action: str, error: Exception) -> None:
    if action not in ctx.failed:
        ctx.failed.add(action)
        announce(
            f"monitor action {action!r} failed ({type(error).__name__}: {error}); "
            "further failures are silent"
        )


def _log(anomaly: Anomaly, ctx: ActionContext) -> None:
    announce(f"anomaly: {anomaly}")


def _event(anomaly: Anomaly, ctx: ActionContext) -> None:
    events.emit("anomaly", **anomaly.to_dict())
    if ctx.sink is not None:
        ctx.sink(anomaly)


def _snapshot(anomaly: Anomaly, ctx: ActionContext) -> None:
    import torch

    ctx.snapshot_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(
        r"[^A-Za-z0-9_.-]+",
        "_",
        f"step{anomaly.step:07d}-{anomaly.rule}-{anomaly.module or 'model'}",
    )
    path = ctx.snapshot_dir / f"{name}.pt"
    module = find_module(ctx.model, anomaly.module)
    tensor = anomaly.tensor.detach().cpu() if anomaly.tensor is not None else None
    state = module.state_dict() if module is not None else None
    torch.save({"anomaly": anomaly.to_dict(), "tensor": tensor, "module_state": state}, path)
    anomaly.details["snapshot"] = str(path)
    announce(f"anomaly snapshot: {path}")


def find_module(model: Any, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except (AttributeError, TypeError):
        return None


# A frame made for the park: pdb skips frames of ``breakpod.*`` modules, so
# this code runs under another module name, with its source in linecache.
_PARK_FILE = "<breakpod anomaly>"
_PARK_SOURCE = """\
def anomaly_frame(anomaly, tensor, module, step, rule, monitor, _park):
    _park(_sys._getframe())
    return  # parked: anomaly, tensor, module, step, rule, monitor are in scope; 'c' resumes
"""


def _park_function() -> Callable[..., None]:
    namespace: dict[str, Any] = {"__name__": "breakpod_anomaly", "_sys": sys}
    linecache.cache[_PARK_FILE] = (
        len(_PARK_SOURCE),
        None,
        _PARK_SOURCE.splitlines(True),
        _PARK_FILE,
    )
    exec(compile(_PARK_SOURCE, _PARK_FILE, "exec"), namespace)
    fn: Callable[..., None] = namespace["anomaly_frame"]
    return fn


def park(anomaly: Anomaly, ctx: ActionContext) -> None:
    """Stop in a debugger with the anomaly's tensor, module, step and rule as locals."""
    from breakpod import shim

    header = f"anomaly: {anomaly}"
    module = find_module(ctx.model, anomaly.module)
    _park_function()(
        anomaly,
        anomaly.tensor,
        module,
        anomaly.step,
        anomaly.rule,
        ctx.monitor,
        lambda frame: shim.set_trace(header=header, frame=frame),
    )


_ACTIONS: dict[str, Callable[[Anomaly, ActionContext], None]] = {
    "log": _log,
    "event": _event,
    "snapshot": _snapshot,
    "break": park,
}
