"""``replay``: run the captured step again, op by op, and name the first bad op.

At an anomaly park the weights are still those the failing step started with
(the park is before the update). :func:`replay` puts back the step's RNG
states and running statistics, runs the root forward on the captured inputs
and the backward from the captured output gradient under
:mod:`breakpod._monitor.timetravel.opwatch`, then restores everything it touched: the
parameters' ``.grad`` (the same tensor objects), the buffers (copied back
bit for bit) and the RNG states. The replay reproduced the step when its
parameter gradients equal the real ones bit for bit.

``replay save PATH`` writes the same material with ``torch.save``;
``breakpod replay PATH --model module:factory`` replays it elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from breakpod._core.errors import BreakpodError
from breakpod._monitor.summaries import summary
from breakpod._monitor.timetravel.capture import (
    Capture,
    StepInputs,
    autocast_as,
    backward_outputs,
    grad_outputs,
    replay_in_progress,
    rng_states,
    set_rng_states,
)
from breakpod._monitor.timetravel.opwatch import BadOp, OpWatch, floats, modes, module_tracking

BUNDLE_VERSION = 2  # 2: every output's gradient, and autocast
OUTPUTS_SHOWN = 4  # the model's outputs a loss-side report shows


class ReplayError(BreakpodError):
    """Replay is not possible here (nothing captured, a bad bundle); the message says why."""


@dataclasses.dataclass
class ReplayReport:
    step: int
    ops: int
    seconds: float
    reproduced: bool | None  # None: no real gradients to compare with
    why_not: str
    first: BadOp | None
    first_any: BadOp | None
    nondeterministic: list[str]
    forwards: int
    outputs: list[str] = dataclasses.field(default_factory=list)  # the model's, replayed
    bad_grad: str = ""  # the output gradient the loss sent, when it was non-finite
    # not reproduced, but the same gradients hold NaN/Inf in the same places (the finite
    # values differ: gradients accumulated over steps, a non-deterministic sum)
    same_nonfinite: bool = False
    loss: str = ""  # the monitor's verdict on this step's loss, when it was non-finite

    def lines(self) -> list[str]:
        out = []
        if self.nondeterministic:
            out.append(
                "warning: non-deterministic CUDA ops met (results may differ run to run): "
                + ", ".join(self.nondeterministic)
            )
        if self.forwards > 1:
            out.append(f"note: {self.forwards} forwards in this step; the last one is replayed")
        said = {True: "reproduced bit-exactly", False: "NOT reproduced", None: "not compared"}
        verdict = said[self.reproduced] + (f" ({self.why_not})" if self.why_not else "")
        out.append(
            f"replay of step {self.step}: forward + backward, {self.ops} ops in "
            f"{self.seconds:.3f} s: {verdict}"
        )
        bad = self.first or self.first_any
        if self.loss_side():
            return out + self._loss_lines(bad)
        out.extend(bad.lines() if bad else ["no op produced a non-finite value"])
        return out

    def loss_side(self) -> bool:
        """The model's forward was finite, the loss (or the gradient it sent back) not."""
        bad = self.first or self.first_any
        return (bad is None or bad.phase == "backward") and bool(self.loss or self.bad_grad)

    def _loss_lines(self, bad: BadOp | None) -> list[str]:
        """The model's forward was finite: the non-finite value came from the loss function,
        outside the model (and outside the replay); what it was given."""
        said = f" ({self.loss})" if self.loss else ""
        out = [
            "no op of the model's forward produced a non-finite value: the loss function "
            f"did, outside the model{said}; its inputs from the model:",
            *(f"  output {i}: {s}" for i, s in enumerate(self.outputs)),
        ]
        if self.bad_grad:
            out.append(f"  the gradient it sent back into the model's output: {self.bad_grad}")
        if bad is not None:
            out.append("  then, in backward from that gradient:")
            out.extend("  " + line for line in bad.lines())
        return out


def replay(model: Any, capture: Capture | None) -> ReplayReport:
    """Replay the last captured step of ``model`` (in place; everything touched is restored)."""
    inputs = _captured(capture)
    return run_step(model, inputs, compare=True)


def run_step(model: Any, inputs: StepInputs, *, compare: bool) -> ReplayReport:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    real_grads = [p.grad for p in params]
    started = time.perf_counter()
    with _restored(model, params, real_grads), replay_in_progress(), torch.enable_grad():
        _load_step_state(model, inputs)
        watch = _instrumented_run(model, inputs)
        reproduced, why = _compare(params, real_grads, inputs) if compare else (None, "")
        same = reproduced is False and _same_nonfinite(params, real_grads)
    report = ReplayReport(
        inputs.step,
        watch.ops,
        time.perf_counter() - started,
        reproduced,
        why,
        watch.first,
        watch.first_any,
        watch.nondeterministic,
        inputs.forwards,
        watch.outputs,
        _bad_grad(inputs.output_grads),
    )
    report.same_nonfinite = same
    return report


def _same_nonfinite(params: list[Any], real: list[Any]) -> bool:
    """Do the replayed gradients hold their NaN/Inf where the real ones do (and some)?"""
    import torch

    seen = False
    for p, g in zip(params, real, strict=True):
        if (p.grad is None) != (g is None):
            return False
        if g is None:
            continue
        mask = torch.isfinite(g)
        if p.grad.shape != g.shape or not torch.equal(torch.isfinite(p.grad), mask):
            return False
        seen = seen or not bool(mask.all())
    return seen


def _bad_grad(grads: list[Any]) -> str:
    import torch

    bad = [g for g in grads if g is not None and not bool(torch.isfinite(g).all())]
    return summary(bad[0]) if bad else ""


def _captured(capture: Capture | None) -> StepInputs:
    if capture is None:
        raise ReplayError(
            "replay capture is off: watch(model, replay=True) or BREAKPOD_REPLAY=1 turns it on"
        )
    if capture.last is None:
        raise ReplayError("no step captured yet: the model's forward has not run under watch()")
    return capture.last


def _instrumented_run(model: Any, inputs: StepInputs) -> OpWatch:

    watch = OpWatch(model, sys._getframe())
    watch.follow_given("the model's input (the batch)", (inputs.args, inputs.kwargs))
    for name, buffer in model.named_buffers():
        watch.follow_given(f"buffer '{name}'", buffer)
    functions, ops = modes(watch)
    hooks = module_tracking(watch)
    try:
        with functions, ops, autocast_as(inputs.autocast), _forward_as(model, inputs):
            result = model(*inputs.args, **inputs.kwargs)
        watch.reached(result)
        watch.outputs = [summary(t) for t in floats(result)[:OUTPUTS_SHOWN]]
        outs = grad_outputs(result)
        node_hooks = watch.hook_graph([out.grad_fn for out in outs])
        watch.phase = "backward"
        with ops:
            backward_outputs(outs, inputs.output_grads)
        for handle in node_hooks:
            handle.remove()
    finally:
        for handle in hooks:
            handle.remove()
    return watch


@contextlib.contextmanager
def _forward_as(model: Any, inputs: StepInputs) -> Iterator[None]:
    """The model's call runs what the step's ran, its own hooks included (the monitors'
    batch check is one). A function patched onto it for that call runs again (Lightning's
    DDP runs training_step so). A data-parallel wrapper's runs the module it holds: DDP's
    forward would prepare its reducer for an all-reduce (and broadcast buffers) that the
    other ranks, not replaying, never join; ``DataParallel``'s would scatter over the
    devices again."""
    import torch

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    forward = inputs.method or (model.module if isinstance(model, wrappers) else None)
    if forward is None:
        yield
        return
    own = model.__dict__.get("forward")
    model.__dict__["forward"] = forward  # Module.__call__ reads self.forward
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


def _compare(params: list[Any], real: list[Any], inputs: StepInputs) -> tuple[bool | None, str]:
    if all(g is None for g in inputs.output_grads):
        return None, "no gradient reached the output in the captured step"
    if all(g is None for g in real):
        return None, "the real step left no gradients to compare with"
    if inputs.forwards > 1:  # equal or not, one forward's gradients say nothing of the sum
        return None, f"the real gradients accumulate {inputs.forwards} forwards; one was replayed"
    for p, g in zip(params, real, strict=True):
        if (p.grad is None) != (g is None) or (g is not None and not same_bits(p.grad, g)):
            return False, "gradients differ"
    return True, ""


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality (NaN payloads included), which ``torch.equal`` cannot say for NaN."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    width = ints.get(a.element_size())
    if width is None or not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))


def _load_step_state(model: Any, inputs: StepInputs) -> None:
    set_rng_states(inputs.rng_cpu, inputs.rng_cuda)
    own = dict(model.named_buffers())
    for name, value in inputs.buffers.items():
        if name in own:
            own[name].copy_(value)


@contextlib.contextmanager
def _restored(model: Any, params: list[Any], grads: list[Any]) -> Iterator[None]:
    """Whatever the replay does, the model leaves it as it came (grads, buffers, RNG)."""
    import torch

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    rng = rng_states()
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        set_rng_states(*rng)


# -- the offline bundle ------------------------------------------------------------


def save_bundle(path: str | Path, model: Any, capture: Capture | None) -> Path:
    """``torch.save`` what a replay needs: inputs, output gradient, RNG, state dict, gradients."""
    import torch

    inputs = _captured(capture)
    if inputs.method is not None:
        raise ReplayError(
            f"step {inputs.step} ran {_name(inputs.method)} through the model's forward, patched "
            "for that call (Lightning's DDP does so): a bundle replayed on the model alone "
            "would run its forward instead; 'replay' in the process runs the step as it ran"
        )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    bundle = {
        "breakpod_replay": BUNDLE_VERSION,
        # the fields as they are: asdict() would turn a dataclass batch into a dict
        "inputs": {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)},
        "state_dict": model.state_dict(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "training": model.training,
    }
    torch.save(bundle, target)
    return target


def _name(method: Any) -> str:
    """What a one-call patch of forward runs: Lightning's names it in its closure."""
    code, cells = getattr(method, "__code__", None), getattr(method, "__closure__", None) or ()
    names = dict(zip(getattr(code, "co_freevars", ()), cells, strict=False))
    named = names.get("method_name")
    value = named.cell_contents if named is not None else None
    return f"{value}()" if isinstance(value, str) else "another function"


def replay_bundle(path: str | Path, model: Any, *, trusted: bool = False) -> ReplayReport:
    """Replay a saved bundle on ``model`` (built by the user's factory, same architecture).

    The bundle is read with ``weights_only`` (tensors, numbers, strings and containers
    only): unpickling anything else runs code the file chooses. A step whose inputs
    hold other objects (a namedtuple batch) is read only when ``trusted``."""
    bundle = _load_bundle(Path(path), trusted)
    if not hasattr(model, "load_state_dict") or not hasattr(model, "named_parameters"):
        raise ReplayError(f"the factory made a {type(model).__name__}, not a torch.nn.Module")
    try:
        model.load_state_dict(bundle["state_dict"])
        model.train(bundle["training"])
        named = dict(model.named_parameters())
        for name, grad in bundle["grads"].items():
            named[name].grad = grad
        inputs = StepInputs(**bundle["inputs"])
    except (RuntimeError, KeyError, TypeError, AttributeError) as e:
        raise ReplayError(f"{path}: the model does not match the bundle ({e!r})") from e
    try:
        return run_step(model, inputs, compare=True)
    except Exception as e:  # the user's forward on the bundle's inputs
        raise ReplayError(
            f"{path}: the model's step failed on the bundle's inputs ({type(e).__name__}: {e})"
        ) from e


def _load_bundle(path: Path, trusted: bool) -> dict[str, Any]:
    import pickle

    import torch

    try:
        bundle = torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as e:
        if trusted or "Unsupported global" not in str(e):  # not an object refused: garbage
            raise ReplayError(f"{path}: cannot read a replay bundle (not a torch file)") from e
        raise ReplayError(
            f"{path}: holds objects other than tensors and containers, which loading would "
            "let the file run code; if you trust who wrote it, add --trust"
        ) from e
    except Exception as e:  # garbage gives torch's unpickler any error
        raise ReplayError(f"{path}: cannot read a replay bundle ({type(e).__name__}: {e})") from e
    version = bundle.get("breakpod_replay") if isinstance(bundle, dict) else None
    if isinstance(version, int) and 0 < version < BUNDLE_VERSION:
        raise ReplayError(f"{path}: a bundle of an older breakpod (format {version}): save again")
    if version != BUNDLE_VERSION:
        raise ReplayError(f"{path}: not a breakpod replay bundle (write one with 'replay save')")
    return dict(bundle)
