"""``whatif``: the current step on a deep copy of model and optimizer, with one change.

    whatif lr=1e-4 | whatif clip=1.0 | whatif skip-batch   [loss=EXPR]

Step N (the parked one) takes the real step's gradients (copied), applies the
change and the optimizer's update on the copy; step N+1 runs forward and
backward again on the same captured batch. Each reports loss, gradient norm
and non-finite counts. ``loss=EXPR`` (evaluated in the parked frame, with
``out`` bound to the copy's output) gives step N+1 a real loss; without it
step N+1's backward starts from the captured output gradient and no loss is
shown. The real model, optimizer, RNG and buffers are untouched: the copy is
made with the hooks set aside, and nothing is written back.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from breakpod._monitor.checks import first_tensor
from breakpod._monitor.timetravel.capture import (
    StepInputs,
    autocast_as,
    backward_outputs,
    grad_outputs,
    replay_in_progress,
    rng_states,
    set_rng_states,
)
from breakpod._monitor.timetravel.replay import ReplayError

CHANGES = "lr=VALUE, clip=MAX_NORM or skip-batch"


@dataclasses.dataclass(frozen=True)
class Change:
    lr: float | None = None
    clip: float | None = None
    skip_batch: bool = False

    def __str__(self) -> str:
        if self.skip_batch:
            return "skip-batch"
        return f"lr={self.lr:g}" if self.lr is not None else f"clip={self.clip:g}"


def parse_change(text: str) -> tuple[Change, str | None]:
    """``lr=1e-4 loss=F.mse_loss(out, y)`` -> (Change(lr=1e-4), "F.mse_loss(out, y)")."""
    words = text.split(None, 1)
    if not words:
        raise ReplayError(f"whatif needs one change: {CHANGES}, e.g. whatif lr=1e-4")
    head, rest = words[0], (words[1] if len(words) > 1 else "").strip()
    loss = None
    if rest:
        if not rest.startswith("loss="):
            raise ReplayError(f"whatif: unexpected {rest!r}; after the change only loss=EXPR")
        loss = rest.removeprefix("loss=").strip()
    if head == "skip-batch":
        return Change(skip_batch=True), loss
    key, eq, value = head.partition("=")
    if key not in ("lr", "clip") or not eq:
        raise ReplayError(f"whatif: unknown change {head!r}; expected {CHANGES}")
    try:
        number = float(value)
    except ValueError:
        raise ReplayError(f"whatif: {key}={value!r} is not a number, e.g. {key}=1e-4") from None
    if number < 0 or math.isnan(number):
        raise ReplayError(f"whatif: {key} must be a non-negative number, got {value}")
    return (Change(lr=number) if key == "lr" else Change(clip=number)), loss


@dataclasses.dataclass
class StepResult:
    name: str
    loss: float | None
    grad_norm: float | None
    nonfinite_grads: int
    nonfinite_params: int
    nonfinite_output: int | None = None

    def line(self) -> str:
        loss = "n/a" if self.loss is None else f"{self.loss:.6g}"
        norm = "none" if self.grad_norm is None else f"{self.grad_norm:.6g}"
        out = (
            "" if self.nonfinite_output is None else f", non-finite output {self.nonfinite_output}"
        )
        return (
            f"{self.name}: loss {loss}, grad norm {norm}, non-finite grads "
            f"{self.nonfinite_grads}, non-finite params after update {self.nonfinite_params}{out}"
        )


def whatif(
    model: Any,
    optimizer: Any,
    inputs: StepInputs,
    change: Change,
    *,
    real_loss: float | None,
    loss_fn: Callable[[Any], Any] | None,
) -> list[StepResult]:
    """Steps N and N+1 on a copy; the real objects are only read."""
    import torch

    if optimizer is None:
        raise ReplayError("whatif needs the optimizer: watch(model, optimizer=opt)")
    clone, opt = copy_model_and_optimizer(model, optimizer)
    saved_rng = rng_states()
    try:
        with replay_in_progress():
            first = _apply(clone, opt, change, f"step {inputs.step} ({change})", real_loss)
            second = _next_step(clone, opt, inputs, change, loss_fn)
    finally:
        set_rng_states(*saved_rng)
    del clone, opt
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return [first, second]


def _apply(model: Any, opt: Any, change: Change, name: str, loss: float | None) -> StepResult:
    import torch

    params = _params(opt)
    if change.skip_batch:
        for p in params:
            p.grad = None
    norm = _grad_norm(params)
    if change.clip is not None and norm is not None:
        torch.nn.utils.clip_grad_norm_(params, change.clip)
    if change.lr is not None:
        for group in opt.param_groups:
            group["lr"] = change.lr
    bad_grads = sum(_nonfinite(p.grad) for p in params if p.grad is not None)
    opt.step()
    return StepResult(name, loss, norm, bad_grads, sum(_nonfinite(p) for p in params))


def _next_step(
    model: Any,
    opt: Any,
    inputs: StepInputs,
    change: Change,
    loss_fn: Callable[[Any], Any] | None,
) -> StepResult:
    import torch

    set_rng_states(inputs.rng_cpu, inputs.rng_cuda)
    opt.zero_grad(set_to_none=True)
    with torch.enable_grad():
        with autocast_as(inputs.autocast):
            output = model(*inputs.args, **inputs.kwargs)
        out = first_tensor(output)
        if out is None:
            raise ReplayError("whatif: the model's forward returned no tensor")
        loss = loss_fn(out) if loss_fn is not None else None
        if loss is not None:
            loss.backward()
        else:  # no loss known: the captured upstream gradients
            backward_outputs(grad_outputs(output), inputs.output_grads)
    value = float(loss.detach().float().mean()) if loss is not None else None
    result = _apply(model, opt, Change(), f"step {inputs.step + 1} (same batch)", value)
    result.nonfinite_output = _nonfinite(out.detach())
    return result


def copy_model_and_optimizer(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """Deep copies that share nothing with the originals, without their hooks."""
    with _hooks_set_aside([*model.modules(), optimizer]):
        memo: dict[int, Any] = {}
        clone = copy.deepcopy(model, memo)
        opt = copy.deepcopy(optimizer, memo)  # the same memo: its params are the clone's
    for real, copied in zip(model.parameters(), clone.parameters(), strict=True):
        copied.grad = None if real.grad is None else real.grad.detach().clone()
    return clone, opt


@contextmanager
def _hooks_set_aside(objects: list[Any]) -> Iterator[None]:
    """Hook dicts hold the monitor's bound methods; a copy must not carry (or copy) them."""
    saved = []
    for obj in objects:
        for key, value in list(vars(obj).items()):
            if "hooks" in key and isinstance(value, dict):
                saved.append((obj, key, value))
                setattr(obj, key, type(value)())
    try:
        yield
    finally:
        for obj, key, value in saved:
            setattr(obj, key, value)


def _params(opt: Any) -> list[Any]:
    return [p for group in opt.param_groups for p in group["params"]]


def _grad_norm(params: list[Any]) -> float | None:
    import torch

    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _nonfinite(t: Any) -> int:
    import torch

    x = t.detach()
    return int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
