"""Anomaly records and the actions a rule takes on them.

Actions: ``log`` (a line on stderr), ``event`` (``events.emit("anomaly",
...)`` plus the monitor's own sink), ``break`` (park in a debugger in the
user's frame that called ``opt.step()`` or ``monitor.step()``, with
``anomaly`` added to its locals), ``snapshot`` (``torch.save`` the offending
tensor and stats), ``skip`` (drop this step's update, like GradScaler),
``stop`` (raise :class:`~breakpod._core.errors.AnomalyError`), or any callable
taking the :class:`Anomaly`. ``event`` runs for every anomaly, whatever the rule
lists (the broker and the dashboard hear of each). Only ``stop`` (and ``BREAKPOD_ON_EXPIRE=exit``)
may end the training loop; every other failure is reported once and swallowed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pdb
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from breakpod import protocol
from breakpod._core import events
from breakpod._core.announce import announce
from breakpod._core.config import BROKER_URL_ENV
from breakpod._core.errors import AnomalyError
from breakpod._debug import breakpoints
from breakpod._debug.pdb_commands import command

ON_EXPIRE_ENV = "BREAKPOD_ON_EXPIRE"
ON_EXPIRE = ("continue", "skip", "exit")
# BREAKPOD_ON_EXPIRE=exit: EX_TEMPFAIL, so a scheduler can tell "restart from a checkpoint".
EXPIRED_STATUS = 75

log = logging.getLogger(__name__)
LOCAL = "anomaly"  # the name the park frame gets for the anomaly


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
    also: list[str] = dataclasses.field(default_factory=list)  # other rules, same tensor
    skipped: bool = False  # the step's update was dropped
    held: bool = False  # a debugger park already held the job for it
    tier: str = ""  # the monitor's tier that found it: sentinel | detailed (tiers.py)
    how: str = "live"  # live: in the step as it ran; replay: by replaying it (sentinel.py)

    def __str__(self) -> str:
        where = self.module or "<model>"
        rules = ", ".join([self.rule, *self.also])
        return f"step {self.step} {self.phase} {where}: [{rules}] {self.summary}"

    def to_dict(self) -> dict[str, Any]:
        """Plain fields for events and snapshots (no tensor)."""
        fields = dataclasses.asdict(dataclasses.replace(self, tensor=None))
        fields.pop("tensor")
        return fields

    def same_tensor(self) -> tuple[Any, ...]:
        """Rules that fired on the same tensor: a parameter or grad_norm group is its own."""
        param = self.details.get("param", self.details.get("group"))
        return (self.step, self.phase, self.module, param)


@dataclasses.dataclass
class ActionContext:
    """What actions need from the monitor."""

    model: Any
    snapshot_dir: Path
    sink: Callable[[Anomaly], Any] | None = None
    monitor: Any = None
    failed: set[str] = dataclasses.field(default_factory=set)
    errors: int = 0  # actions that failed (each kind said once)
    # The user's frame at the step boundary (where a break parks), while actions run.
    frame: FrameType | None = None
    # the step whose update to drop: asked by the skip action, the pdb ``skip`` command or
    # the hold expiry
    skip: int | None = None
    parked_step: int | None = None  # the last step an anomaly park held: its update is decided

    def take_skip(self, step: int) -> bool:
        """Drop ``step``'s update? A skip asked for an earlier step comes too late: that
        update was applied before the anomaly was found (a loss given after the
        optimizer's step), and the update of this step is no fault of it."""
        asked, self.skip = self.skip, None
        if asked is not None and asked != step:
            announce(
                f"step {asked}: update not skipped: it was applied before the anomaly was "
                "found (with optimizer=, call monitor.record_loss(loss) before "
                "optimizer.step() to judge the loss in time)"
            )
        return asked == step


Found = tuple[Anomaly, Any]


def merge_same_tensor(found: list[Found]) -> list[tuple[Anomaly, tuple[Any, ...]]]:
    """One anomaly, one report: rules firing on the same tensor in a step share one line."""
    merged: dict[tuple[Any, ...], tuple[Anomaly, tuple[Any, ...]]] = {}
    for anomaly, rule in found:
        key = anomaly.same_tensor()
        if key not in merged:
            merged[key] = (anomaly, tuple(rule.actions))
            continue
        first, actions = merged[key]
        first.also.append(rule.name)
        merged[key] = (first, actions + tuple(a for a in rule.actions if a not in actions))
    return list(merged.values())


def dispatch(anomaly: Anomaly, actions: tuple[Any, ...], ctx: ActionContext) -> None:
    """Run each action; ``stop`` runs last so the others still happen.

    The rule's actions add to the ``event``, never replace it: every anomaly reaches
    the event hub (and the broker, the dashboard, the flight dump it carries), first,
    before a park or a stop."""
    if "event" not in actions:
        actions = ("event", *actions)
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
    ctx.errors += 1
    if action not in ctx.failed:
        ctx.failed.add(action)
        announce(
            f"monitor action {action!r} failed ({type(error).__name__}: {error}); "
            "further failures are silent"
        )


def _log(anomaly: Anomaly, ctx: ActionContext) -> None:
    announce(f"anomaly: {anomaly}")


def _event(anomaly: Anomaly, ctx: ActionContext) -> None:
    events.emit(protocol.ANOMALY, **anomaly.to_dict())
    if ctx.sink is not None:
        ctx.sink(anomaly)
    elif not os.environ.get(BROKER_URL_ENV) and "event" not in ctx.failed:
        ctx.failed.add("event")  # said once: where the rule's events go without a broker
        announce(
            f"anomaly events: no broker ({BROKER_URL_ENV} unset) and no sink=; they reach "
            "breakpod._core.events sinks and monitor.anomalies only"
        )


def _snapshot(anomaly: Anomaly, ctx: ActionContext) -> None:
    import torch

    ctx.snapshot_dir.mkdir(parents=True, exist_ok=True)
    path = _snapshot_path(anomaly, ctx.snapshot_dir)
    module = find_module(ctx.model, anomaly.module)
    tensor = anomaly.tensor.detach().cpu() if anomaly.tensor is not None else None
    state = module.state_dict() if module is not None else None
    content = {"anomaly": anomaly.to_dict(), "tensor": tensor, "module_state": state}
    if anomaly.phase in ("backward", "param") and module is not None:
        content["grads"] = _grads(module, anomaly)
    torch.save(content, path)
    anomaly.details["snapshot"] = str(path)
    announce(f"anomaly snapshot: {path}")


def _snapshot_path(anomaly: Anomaly, folder: Path) -> Path:
    """``step0000012-<rule>-<module>[-<param>].pt``; never over another anomaly's file."""
    param = _param_of(anomaly)
    leaf = f"-{param.rpartition('.')[2]}" if param and param != anomaly.module else ""
    stem = f"step{anomaly.step:07d}-{anomaly.rule}-{anomaly.module or 'model'}{leaf}"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)
    path, n = folder / f"{stem}.pt", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.pt"
    return path


def _param_of(anomaly: Anomaly) -> str | None:
    """The parameter (or grad_norm group) an anomaly names; None for a module or all."""
    param = anomaly.details.get("param") or anomaly.details.get("group")
    return None if param in (None, "", "<total>") else str(param)


def _grads(module: Any, anomaly: Anomaly) -> dict[str, Any]:
    """The gradients the anomaly is about (its parameter's, or its module's), on the CPU,
    as they are when the action runs (before the update when a rule needs the verdict)."""
    param = _param_of(anomaly)
    prefix = f"{anomaly.module}." if anomaly.module else ""
    from breakpod._monitor.sharding import local

    return {  # a sharded one's: this rank's shard (the others' would need them)
        name: local(p.grad).detach().cpu()
        for name, p in module.named_parameters()
        if p.grad is not None and (not param or param in (prefix + name, anomaly.module))
    }


def find_module(model: Any, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except (AttributeError, TypeError):
        return None


# The anomaly parks in progress, with their steps (the pdb ``skip`` command acts on them).
_PARKED: list[tuple[ActionContext, int]] = []


def parked_context() -> ActionContext | None:
    """The innermost anomaly park's context (the tensor commands read its monitor)."""
    return _PARKED[-1][0] if _PARKED else None


def park(anomaly: Anomaly, ctx: ActionContext) -> None:
    """Hold in a debugger in the user's frame, before the optimizer applies the step.

    ``anomaly`` (with ``.tensor``) joins the frame's locals for the session. When
    the hold expires, ``BREAKPOD_ON_EXPIRE`` says whether to continue, skip or exit.
    """
    frame = ctx.frame if ctx.frame is not None else _caller_frame()
    added = LOCAL not in frame.f_locals
    if added:
        frame.f_locals[LOCAL] = anomaly
    _PARKED.append((ctx, anomaly.step))
    ctx.parked_step = anomaly.step
    try:
        attached = breakpoints.hold(frame, header=f"anomaly: {anomaly}")
    finally:
        _PARKED.pop()
        if added:
            frame.f_locals.pop(LOCAL, None)
    anomaly.held = attached
    if not attached:
        _expired(anomaly, ctx)


def _caller_frame() -> FrameType:
    return user_frame(sys._getframe(1))


def user_frame(frame: FrameType) -> FrameType:
    """The innermost frame outside torch and breakpod (when the optimizer's step
    hook ends the step, the caller is torch's wrapper); ``frame`` if there is none."""
    found: FrameType | None = frame
    while found is not None and library_frame(found):
        found = found.f_back
    return found if found is not None else frame


def library_frame(frame: FrameType) -> bool:
    package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
    return package in ("torch", "breakpod")


def on_expire(environ: Any = None) -> str | None:
    """``BREAKPOD_ON_EXPIRE``: continue, skip or exit; None when unset (the default, see
    :func:`expiry_policy`); a bad value is announced and taken as unset."""
    value = (os.environ if environ is None else environ).get(ON_EXPIRE_ENV)
    if value is None or not value.strip():
        return None
    if value.strip().lower() in ON_EXPIRE:
        return str(value.strip().lower())
    announce(
        f"{ON_EXPIRE_ENV}={value!r}: expected one of {', '.join(ON_EXPIRE)}; using the "
        "default (skip a non-finite update, else continue)"
    )
    return None


def expiry_policy(anomaly: Anomaly, environ: Any = None) -> str:
    """What an expired hold does: ``BREAKPOD_ON_EXPIRE``, else skip the update of a step
    whose values are non-finite (it would write NaN/Inf into the weights, as GradScaler
    refuses to) and continue after any other anomaly."""
    chosen = on_expire(environ)
    if chosen is not None:
        return chosen
    return "skip" if nonfinite_values(anomaly) else "continue"


def nonfinite_values(anomaly: Anomaly) -> bool:
    """NaN or Inf in the values (not a finite tensor whose L2 norm overflowed)."""
    return anomaly.check == "nonfinite" and anomaly.details.get("kind") != "overflow"


def _expired(anomaly: Anomaly, ctx: ActionContext) -> None:
    policy = expiry_policy(anomaly)
    if policy == "skip":
        ctx.skip = anomaly.step
        why = (
            f"{ON_EXPIRE_ENV}=skip"
            if on_expire() == "skip"
            else f"its values are non-finite; {ON_EXPIRE_ENV}=continue applies it"
        )
        announce(
            f"anomaly hold expired with nobody attached: step {anomaly.step}'s update will be "
            f"skipped ({why})"
        )
    elif policy == "exit":
        why = f"anomaly hold expired ({ON_EXPIRE_ENV}=exit): {anomaly}"
        announce(f"{why}; exiting with status {EXPIRED_STATUS}")
        events.emit(protocol.FINISHED, status=EXPIRED_STATUS, why=why, **anomaly.to_dict())
        raise SystemExit(EXPIRED_STATUS)


def _skip(anomaly: Anomaly, ctx: ActionContext) -> None:
    if not anomaly.skipped and "applied" not in anomaly.details:  # else the device decided
        ctx.skip = anomaly.step


@command("skip")
def skip_command(debugger: pdb.Pdb, arg: str) -> bool:
    """skip: drop this step's update (gradients dropped, the optimizer step changes
    nothing), then continue. Only at an anomaly park before the optimizer step."""
    if not _PARKED:
        debugger.error("skip: only at an anomaly park (a rule with action 'break')")
        return False
    ctx, step = _PARKED[-1]
    ctx.skip = step
    debugger.message("breakpod: this step's update will be skipped")
    return bool(debugger.do_continue(arg))


_ACTIONS: dict[str, Callable[[Anomaly, ActionContext], None]] = {
    "log": _log,
    "event": _event,
    "snapshot": _snapshot,
    "break": park,
    "skip": _skip,
}
