"""Debug mode with no code: the model is found and watched; the optimizer's steps are steps.

Installed by :mod:`breakpod._integrations.autostart` once ``import torch`` is done,
in debug mode (``ENABLE_REMOTE_DEBUG=1``) only:

* **Finding the model.** A global forward pre-hook notes every module that runs
  until the first optimizer step. When that step is done (a global step
  post-hook) the outermost modules that ran and hold parameters of the optimizer
  are the models; the global forward hook is removed then, and costs nothing
  more. They are watched once the second step is done, unless the program
  called ``breakpod.step()`` in between: it marks its own steps, and a monitor's
  step ends would be boundaries of another count. A wrapper (DistributedDataParallel,
  Lightning's) is looked through to the model it wraps, so modules keep the names
  the user gave them.
* **Anomalies** (``BREAKPOD_AUTO_WATCH``): each model found is ``watch()``-ed from
  the third step on with the default rules, a non-finite value parking
  (``BREAKPOD_RULES=rules.yaml`` adds or replaces rules). Its step ends *before
  the update*: ``watch(optimizer=...)``'s own step pre-hook, or, for an optimizer
  stepped with a closure (Lightning: forward and backward run inside ``step()``,
  after any pre-hook), a global pre-hook that has the closure end the step when
  it returns. A park sees the previous step's weights, with the model, the
  optimizer and the framework's frames reachable (``up``).
* **Step boundaries** (``BREAKPOD_AUTO_STEPS``): :mod:`breakpod._job.optimizer_steps`;
  a forward pre-hook on each model found (it ran before the first step, so it runs
  each step; an evaluation runs it too) tells the stall watchdog the job is alive.

Every failure here is said once; training goes on.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.compiling import compiling_check
from breakpod._core.config import env_flag
from breakpod._core.errors import AnomalyError
from breakpod._job import optimizer_steps
from breakpod._monitor import optimizers
from breakpod._monitor.monitor import Monitor, monitor_of, watch
from breakpod._monitor.root_hooks import layers, live_instances

AUTO_WATCH_ENV = "BREAKPOD_AUTO_WATCH"
AUTO_STEPS_ENV = "BREAKPOD_AUTO_STEPS"
RULES_ENV = "BREAKPOD_RULES"
# debug mode's default: a non-finite value parks before the update (the other defaults log)
PARK = ["log", "event", "break"]  # rule actions
PARK_ON_NONFINITE = {"name": "nonfinite", "check": "nonfinite", "action": PARK}

_ran: dict[int, Any] = {}  # modules that ran a forward before the first optimizer step
_traced = [False]  # some module ran inside a compiled graph, where _note cannot keep it
_handles: list[Any] = []
_forward_handle: Any = None
_roots: list[weakref.ref[Any]] | None = None  # the outermost modules that ran
_adopted: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers done with
_found: weakref.WeakKeyDictionary[Any, list[weakref.ref[Any]]] = weakref.WeakKeyDictionary()
_monitors: dict[int, Monitor] = {}  # id(model) -> its monitor
# id(monitor) -> the optimizer, stepped with a closure, whose steps end the monitor's
_closure_stepped: dict[int, Any] = {}
_wanted = {"watch": False, "steps": False}
_failed: set[str] = set()
_compiling = compiling_check()  # looked up again at install(), once torch is imported


def install() -> None:
    """Register the global hooks (torch is imported); nothing when both are switched off."""
    _wanted["watch"] = env_flag(AUTO_WATCH_ENV, True)
    _wanted["steps"] = env_flag(AUTO_STEPS_ENV, True)
    if not any(_wanted.values()) or _handles:
        return
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    global _forward_handle, _compiling
    _compiling = compiling_check()
    _forward_handle = register_module_forward_pre_hook(_note)
    if _wanted["watch"]:  # a closure-stepped optimizer's monitors end their steps there
        _handles.append(register_optimizer_step_pre_hook(_before_step))
    _handles.append(register_optimizer_step_post_hook(_after_step))  # finds the models
    if _wanted["steps"]:
        optimizer_steps.install()


def remove() -> None:
    """Every hook off (tests; a job never needs it)."""
    global _forward_handle, _roots
    for handle in _handles:
        handle.remove()
    _handles.clear()
    if _forward_handle is not None:
        _forward_handle.remove()
        _forward_handle = None
    for monitor in _monitors.values():
        monitor.close()
    _monitors.clear()
    _closure_stepped.clear()
    _ran.clear()
    _traced[0] = False
    _roots = None
    _adopted.clear()
    _found.clear()
    optimizer_steps.remove()


def monitors() -> list[Monitor]:
    return list(_monitors.values())


def _note(module: Any, args: Any) -> None:
    if _compiling():  # dynamo traces global hooks, and a write into _ran fails its trace
        _traced[0] = True  # (a constant's does not: dynamo replays it after the graph)
        return  # (a compiled module's wrapper, OptimizedModule, is noted: it runs eagerly)
    _ran[id(module)] = module


def _before_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Global step pre-hook, for the models of an optimizer stepped with a closure: their
    step ends when the closure returns (forward and backward are done, the update not)."""
    if not _closure_stepped:
        return None
    try:
        watched = [m for m in _monitors.values() if _closure_stepped.get(id(m)) is optimizer]
        if not watched:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if callable(closure):
            return _with_closure(args, kwargs, _then(closure, lambda x: _end_steps(watched, x)))
        _end_steps(watched, None)
    except AnomalyError:
        raise  # a `stop` rule: training was asked to stop
    except Exception as e:
        _fail("ending the step", e)
    return None


def _after_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Global step post-hook: a new optimizer's models are found once its first step is
    done, and watched once its second is (unless the program marked steps in between)."""
    try:
        if optimizer in _adopted:
            return
        found = _found.get(optimizer)
        if found is None:
            _find(optimizer)
            return
        _adopted.add(optimizer)
        del _found[optimizer]
        if not _wanted["watch"] or _program_marks_steps():
            return
        closure = callable(kwargs.get("closure", args[0] if args else None))
        for model in [ref() for ref in found]:
            if model is not None and id(model) not in _monitors and monitor_of(model) is None:
                _watch(model, optimizer, closure)  # a model the program watches is left to it
    except Exception as e:
        _fail("finding the model", e)


def _find(optimizer: Any) -> None:
    """The models this optimizer steps: found once some module ran (else looked for again
    at its next step); the stall clock hears their forwards from now."""
    global _roots
    if _roots is None:
        ran = outermost(_ran.values()) or _ran_compiled(optimizer)
        if not ran:
            return
        _roots = [weakref.ref(m) for m in ran]
        _stop_noting()
    held = {id(p) for p in optimizers.params_of(optimizer)}
    models = [m for m in (r() for r in _roots) if m is not None and _holds(m, held)]
    for model in models:
        _keep_alive(model)
    _found[optimizer] = [weakref.ref(unwrap(m)) for m in models]


def _program_marks_steps() -> bool:
    """``breakpod.step()`` ran since the first optimizer step: the program marks its steps,
    and the zero-code monitor (whose step ends would be boundaries too) stays out."""
    if not optimizer_steps.others_mark_steps():
        return False
    if "steps" not in _failed:
        _failed.add("steps")
        announce(
            "debug mode: the program marks its own steps (breakpod.step()); no model is "
            "watched without code: call breakpod.watch(model, optimizer=...) for anomalies"
        )
    return True


def _stop_noting() -> None:
    global _forward_handle
    if _forward_handle is not None:
        _forward_handle.remove()
        _forward_handle = None
    _ran.clear()


def _ran_compiled(optimizer: Any) -> list[Any]:
    """The models that ran only inside compiled graphs (Lightning compiles ``training_step``
    itself), where ``_note`` could not keep them: the outermost modules that hold the
    optimizer's parameters, found by one pass over the collector's objects."""
    if not _traced[0]:
        return []
    from torch.nn import Module

    held = {id(p) for p in optimizers.params_of(optimizer)}
    return outermost(m for m in live_instances(Module) if _holds(m, held))


def outermost(modules: Iterable[Any]) -> list[Any]:
    """The modules with parameters that no other one of them contains."""
    holding = [m for m in modules if next(iter(m.parameters()), None) is not None]
    inside = {id(c) for m in holding for c in m.modules() if c is not m}
    return [m for m in holding if id(m) not in inside]


def unwrap(model: Any) -> Any:
    return layers(model)[-1]


def _holds(model: Any, held: set[int]) -> bool:
    return any(id(p) in held for p in model.parameters())


def _keep_alive(model: Any) -> None:
    """Forwards (an evaluation too) keep the stall clock from counting silence."""
    if not _wanted["steps"]:
        return
    _handles.append(model.register_forward_pre_hook(_alive))  # it ran: it runs each step


def _alive(module: Any, args: Any) -> None:
    if not _compiling():  # traced, its clock read would fail a fullgraph compile
        optimizer_steps.alive()


def _watch(model: Any, optimizer: Any, closure: bool) -> None:
    rules = os.environ.get(RULES_ENV, "").strip()
    config = {"rules": [PARK_ON_NONFINITE]}
    hooked = None if closure else optimizer  # a closure's forward comes after its pre-hook
    try:
        monitor = watch(model, rules or None, config=config, optimizer=hooked)
    except Exception as e:  # an unreadable or wrong BREAKPOD_RULES: the defaults watch
        announce(f"{RULES_ENV}={rules}: {e}; the model is watched with the default rules")
        monitor = watch(model, config=config, optimizer=hooked)
    if closure:
        _closure_stepped[id(monitor)] = optimizer
    _monitors[id(model)] = monitor
    # watched from the optimizer's third step on: numbered as the optimizer's steps
    monitor.step_count = monitor._current.step = 2
    name = type(model).__name__
    announce(f"debug mode: watching {name} for anomalies; they park before the update")


def _end_steps(watched: list[Monitor], loss: Any) -> None:
    """Before the update: each watched model's step ends (a park happens here)."""
    loss = loss if isinstance(loss, _tensor_type()) else None  # what a closure returned
    for monitor in watched:
        monitor.step(loss)


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def _then(closure: Callable[[], Any], after: Callable[[Any], None]) -> Callable[[], Any]:
    """The closure, then ``after(its loss)``: a failure there is said once."""

    def closure_then() -> Any:
        loss = closure()
        try:
            after(loss)
        except AnomalyError:
            raise
        except Exception as e:
            _fail("the step's end", e)
        return loss

    return closure_then


def _with_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (closure, *args[1:]), kwargs


def _fail(where: str, error: Exception) -> None:
    if where not in _failed:
        _failed.add(where)
        announce(f"debug mode: {where} failed ({type(error).__name__}: {error}); training goes on")


__all__ = ["install", "monitors", "outermost", "remove", "unwrap"]
