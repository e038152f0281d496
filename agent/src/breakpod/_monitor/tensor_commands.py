"""pdb commands for tensors, in every breakpod pdb session (loaded when torch is).

tstat EXPR    one-line summary of a tensor (or of each tensor in a list/dict)
tshape MODEL  last input/output shapes per module, as the monitor saw them (runs nothing)
tgrad MODEL   gradient norm and non-finite counts per parameter
tmem          CUDA memory per device, or the process RSS
tnan MODEL    where non-finite values were seen: monitor anomalies and a scan now
replay        re-run the parked step op by op: the first op that went non-finite
replay save PATH   write the step (inputs, output grad, RNG, state) for `breakpod replay`
whatif CHANGE the parked step on a copy with lr=X, clip=X or skip-batch, and the next one
flight [MODULE]    the flight recorder: each module's first bad step, or one module's steps
"""

from __future__ import annotations

import pdb
import resource
import sys
from typing import Any

from breakpod._debug.registry import CommandSet
from breakpod._monitor.anomaly import parked_context
from breakpod._monitor.flight import table as flight_table
from breakpod._monitor.monitor import MONITORS, Monitor, monitor_of
from breakpod._monitor.sharding import local, shard_of
from breakpod._monitor.summaries import nonfinite_counts, summary
from breakpod._monitor.timetravel import replay, whatif

TENSOR_COMMANDS = CommandSet()  # the package's face registers them once torch is loaded
command = TENSOR_COMMANDS.command


def _eval(debugger: pdb.Pdb, expr: str) -> Any:
    if not expr:
        raise ValueError("an expression is needed, e.g. tstat tensor")
    frame = debugger.curframe
    assert frame is not None
    return eval(expr, frame.f_globals, debugger.curframe_locals)


def _model(debugger: pdb.Pdb, expr: str) -> Any:
    value = _eval(debugger, expr or "model")
    model = getattr(value, "model", value)  # a Monitor stands for its model
    if not hasattr(model, "named_modules"):
        raise TypeError(
            f"{expr or 'model'} is a {type(value).__name__}, not an nn.Module or Monitor"
        )
    return model


@command("tstat")
def tstat(debugger: pdb.Pdb, arg: str) -> None:
    """tstat EXPR: one line per tensor: shape, dtype, device, size, range, mean, std, nan/inf."""
    value = _eval(debugger, arg)
    if isinstance(value, dict):
        for key, item in value.items():
            debugger.message(f"{key}: {summary(item)}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            debugger.message(f"[{i}]: {summary(item)}")
    else:
        debugger.message(summary(value))


@command("tshape")
def tshape(debugger: pdb.Pdb, arg: str) -> None:
    """tshape MODEL: last input -> output shapes of each watched module (runs nothing)."""
    model = _model(debugger, arg)
    monitor = monitor_of(model)
    if monitor is None or not monitor.shapes:
        debugger.message("no shapes seen: watch the model with breakpod.watch() and run a step")
        return
    for name, (inputs, output) in monitor.shapes.items():
        ins = ", ".join(str(list(s)) for s in inputs)
        debugger.message(f"{name or '<model>'}: ({ins}) -> {list(output)}")


@command("tgrad")
def tgrad(debugger: pdb.Pdb, arg: str) -> None:
    """tgrad MODEL: gradient L2 norm and nan/inf counts of each parameter (of this rank's
    shard, for a sharded one: reading the others' would wait for them)."""
    for name, param in _model(debugger, arg).named_parameters():
        if param.grad is None:
            debugger.message(f"{name}: no grad")
            continue
        grad = local(param.grad).detach()
        counts = nonfinite_counts(grad)
        bad = " ".join(f"{k}={v}" for k, v in counts.items() if v)
        norm = float((grad if grad.is_complex() else grad.float()).norm())
        shard = " (this rank's shard)" if shard_of(param.grad) else ""
        debugger.message(f"{name}: |grad|={norm:.4g}{' ' + bad if bad else ''}{shard}")


@command("tmem")
def tmem(debugger: pdb.Pdb, arg: str) -> None:
    """tmem: CUDA memory per device (allocated/reserved/peak), or the process RSS."""
    torch = sys.modules["torch"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            gib = 1024**3
            debugger.message(
                f"cuda:{i}: allocated {torch.cuda.memory_allocated(i) / gib:.2f} GiB, "
                f"reserved {torch.cuda.memory_reserved(i) / gib:.2f} GiB, "
                f"peak {torch.cuda.max_memory_allocated(i) / gib:.2f} GiB"
            )
        return
    debugger.message(f"no CUDA device; process RSS {_rss_mib():.1f} MiB")


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, in KiB on Linux


@command("tnan")
def tnan(debugger: pdb.Pdb, arg: str) -> None:
    """tnan MODEL: non-finite values the monitor reported, and those in parameters/grads now."""
    model = _model(debugger, arg)
    monitor = monitor_of(model)
    seen = [a for a in (monitor.anomalies if monitor else []) if a.check == "nonfinite"]
    for anomaly in seen:
        debugger.message(f"reported: {anomaly}")
    found = 0
    for name, param in model.named_parameters():
        for what, tensor in (("param", param), ("grad", param.grad)):  # this rank's shard
            counts = nonfinite_counts(local(tensor)) if tensor is not None else {}
            if any(counts.values()):
                found += 1
                debugger.message(
                    f"now: {what} {name}: " + " ".join(f"{k}={v}" for k, v in counts.items())
                )
    if not seen and not found:
        debugger.message("no non-finite values reported or present in parameters/gradients")


def _monitor_here(debugger: pdb.Pdb) -> Monitor:
    """The parked anomaly's monitor, else the only open one."""
    parked = parked_context()
    if parked is not None and isinstance(parked.monitor, Monitor):
        return parked.monitor
    open_ = [m for ref in list(MONITORS.values()) if (m := ref()) is not None]
    if len(open_) == 1:
        return open_[0]
    raise ValueError(f"{len(open_)} watched models and no parked anomaly: nothing to choose")


@command("replay")
def replay_command(debugger: pdb.Pdb, arg: str) -> None:
    """replay | replay save PATH: re-run the parked step op by op, or write it to PATH."""
    monitor = _monitor_here(debugger)
    verb, _, rest = arg.partition(" ")
    if verb == "save":
        if not rest.strip():
            raise ValueError("replay save needs a file path, e.g. replay save /tmp/step.pt")
        path = replay.save_bundle(rest.strip(), monitor.model, monitor.capture)
        debugger.message(f"saved; replay it with: breakpod replay {path} --model module:factory")
        return
    if verb:
        raise ValueError(f"replay: unknown argument {verb!r}; use 'replay' or 'replay save PATH'")
    report = monitor.replay()
    for line in report.lines():
        debugger.message(line)
    if report.loss_side():  # the loss's other inputs (the targets) are the loop's
        for line in _frame_tensors(debugger):
            debugger.message(line)


FRAME_TENSORS = 8  # the parked frame's tensors a loss-side replay lists


def _frame_tensors(debugger: pdb.Pdb) -> list[str]:
    """The parked frame's tensors (but the loss): the loss function's other inputs."""
    import torch

    found = [
        f"    {name}: {summary(value)}"
        for name, value in debugger.curframe_locals.items()
        if isinstance(value, torch.Tensor) and name != "loss"
    ]
    head = "  tensors in the parked frame (the loss's other inputs among them):"
    return [head, *found[:FRAME_TENSORS]] if found else []


@command("whatif")
def whatif_command(debugger: pdb.Pdb, arg: str) -> None:
    """whatif lr=X | clip=X | skip-batch [loss=EXPR]: this step and the next on a copy."""
    monitor = _monitor_here(debugger)
    change, loss_expr = whatif.parse_change(arg)
    inputs = replay._captured(monitor.capture)
    loss_fn = None
    if loss_expr is not None:
        frame = debugger.curframe
        assert frame is not None
        scope = dict(frame.f_globals)
        scope.update(debugger.curframe_locals)

        def loss_fn(out: Any) -> Any:
            return eval(loss_expr, scope, {"out": out})

    results = whatif.whatif(
        monitor.model,
        monitor._optimizer,
        inputs,
        change,
        real_loss=_frame_loss(debugger),
        loss_fn=loss_fn,
    )
    debugger.message(f"whatif {change} on a copy (the real model is untouched):")
    for result in results:
        debugger.message("  " + result.line())


def _frame_loss(debugger: pdb.Pdb) -> float | None:
    """The parked step's loss, when the user's frame holds it as ``loss``."""
    value = debugger.curframe_locals.get("loss")
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return None


@command("flight")
def flight_command(debugger: pdb.Pdb, arg: str) -> None:
    """flight [MODULE]: the last steps of every watched module, and where each first went
    non-finite or out of range; with MODULE (or <loss>), that one's kept steps."""
    monitor = _monitor_here(debugger)
    if monitor.flight is None:
        raise ValueError("the flight recorder is off (BREAKPOD_FLIGHT_STEPS=0)")
    dump = monitor.flight.dump()
    if dump is None:
        raise ValueError("the device did not finish copying the flight recorder; try again")
    if not arg.strip():
        for line in flight_table.lines(dump.fields(limit=len(dump.series))):
            debugger.message(line)
        return
    found = [s for s in dump.series if s.module == arg.strip()]
    if not found:
        names = sorted({s.module for s in dump.series})
        raise ValueError(f"flight: no watched module {arg.strip()!r}; watched: {', '.join(names)}")
    for series in found:
        for line in flight_table.series_lines(series):
            debugger.message(line)
