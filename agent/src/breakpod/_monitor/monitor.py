"""``breakpod.watch(model)``: tensor monitors with no host-device sync on the hot path.

How a step flows:

* forward hooks reduce each watched module's output on its device
  (:mod:`breakpod._monitor.checks`), each statistic one kernel writing into
  the slot table's preallocated buffer (:class:`~breakpod._monitor.stats.SlotTable`),
  and register a gradient hook on its inputs, which does the same;
  shape contracts are checked from metadata, on the host, at once;
* at the end of each backward, one fused ``_foreach_norm`` gives every
  parameter's gradient norm;
* at the step boundary (:meth:`Monitor.step`, or the optimizer's step
  *pre*-hook, before the update is applied) the step's small stats tensors
  are concatenated into one per device;
* every ``check_every`` steps the host reads them (a non-blocking copy to
  pinned memory on CUDA, evaluated at the next boundary once it landed); the
  slot table judges every module's statistics at once, as vectors, and
  :mod:`breakpod._monitor.detect` turns the few flagged ones into
  :class:`~breakpod._monitor.anomaly.Anomaly` records, handed to each rule's actions;
* when a rule would ``break``, ``stop`` or ``skip``, the answer is needed
  before the update: the boundary then reads once per step and waits, so a
  park still sees the previous step's weights and ``skip`` can drop the update.

Nothing in a hook reads a tensor on the host. A failure inside the monitor
is reported once and swallowed; only ``action: stop`` raises into training.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from breakpod._core import events, wiring
from breakpod._core.announce import announce
from breakpod._core.config import env_flag
from breakpod._core.errors import AnomalyError, ConfigError, RuleError
from breakpod._job import boundary
from breakpod._monitor import checks, optimizers, staging
from breakpod._monitor.anomaly import ActionContext, Anomaly, dispatch, merge_same_tensor
from breakpod._monitor.anomaly import user_frame as _user_frame
from breakpod._monitor.capture import REPLAYING, Capture, capture_wanted, replaying
from breakpod._monitor.compiled import apply_compile_policy, unwrap_compiled
from breakpod._monitor.detect import Detector, ParamInfo, Slot
from breakpod._monitor.flight import FlightRecorder, flight_steps
from breakpod._monitor.norms import NormPlan
from breakpod._monitor.rules import Rule, load_rules, parse_rule, read_yaml, strict_bool
from breakpod._monitor.stats import (
    Entry,
    HostBuffers,
    SlotTable,
    StepRecord,
    by_device,
    copy_events,
    decode,
    landed,
    pack,
    to_host,
)

log = logging.getLogger(__name__)

ACTIVATION_CHECKS = ("nonfinite", "activation", "dead_units")
# Each monitor marks the tensors it checked with attributes of its own, so that a later
# monitor (watch() again, another model sharing a module) is not kept off them.
_MONITOR_IDS = itertools.count()
# model -> its monitor. Weak both ways: the monitor holds the model, so a strong
# value would keep every watched model (and its hooks) alive forever.
MONITORS: weakref.WeakKeyDictionary[Any, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()
REPLACED_EVERY = 64  # gradient collections between looks for replaced parameters
PROBED = 4  # parameters whose version counters tell that an update was applied


Shapes = tuple[list[tuple[int, ...]], tuple[int, ...]]  # a module's input and output shapes


JUDGE_LABEL = "breakpod.judge"  # the host-side judgement, as profiler traces name it


def monitor_of(model: Any) -> Monitor | None:
    """The open monitor watching ``model``, if any (``tshape``/``tnan`` use it)."""
    ref = MONITORS.get(model)
    return ref() if ref is not None else None


def monitor_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``BREAKPOD_MONITOR`` or ``AI_DEBUG_MODE`` is set to a false value."""
    return all(env_flag(var, True, environ) for var in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE"))


def watch(
    model: Any,
    rules: Any = None,
    *,
    check_every: int | None = None,
    config: Any = None,
    optimizer: Any = None,
    expect: Mapping[str, Any] | None = None,
    sink: Callable[[Anomaly], Any] | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    replay: bool | None = None,  # timetravel: capture for `replay`/`whatif` (see capture.py)
) -> Monitor:
    """Watch ``model`` with the default rules plus ``rules``; see the README's "Tensor monitors".

    ``config`` is a mapping or YAML file with any of ``rules``, ``defaults``,
    ``check_every``, ``expect`` and ``snapshot_dir``; explicit arguments win.
    With ``BREAKPOD_MONITOR=0`` (or ``AI_DEBUG_MODE=0``) nothing is installed.
    """
    _check_arguments(model, optimizer, expect)
    optimizer = _hooked_optimizer(optimizer)
    settings = _config(config)
    every = check_every if check_every is not None else settings.get("check_every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"check_every={every!r}: expected a positive integer (1 = every step)")
    merged = _merge_rules(settings, rules, {**settings.get("expect", {}), **(expect or {})})
    apply_compile_policy()  # explicit in the environment, so honoured even when disabled
    enabled = monitor_enabled()
    if enabled:
        model = unwrap_compiled(model)
        wiring.connect()  # anomaly events and broker commands, when a broker is set
    folder = Path(snapshot_dir or settings.get("snapshot_dir") or "breakpod-snapshots")
    ctx = ActionContext(model=model, snapshot_dir=folder, sink=sink)
    monitor = Monitor(
        model, merged, check_every=every, optimizer=optimizer, ctx=ctx, enabled=enabled
    )
    monitor.start_capture(replay)  # timetravel
    return monitor


def _check_arguments(model: Any, optimizer: Any, expect: Any) -> None:
    """What ``watch()`` is given, said plainly rather than failing deep inside torch."""
    if not callable(getattr(model, "named_modules", None)):
        raise ConfigError(f"watch(model): expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        got = type(optimizer).__name__
        raise ConfigError(f"watch(optimizer=...): expected a torch.optim.Optimizer, got {got}")
    if expect is not None and not isinstance(expect, Mapping):
        raise ConfigError(
            f"watch(expect={expect!r}): expected a mapping of module names to shapes, "
            "e.g. {'fc1': 'B,128'}"
        )


def _hooked_optimizer(optimizer: Any) -> Any:
    """What actually steps under a framework's wrapper (see optimizers.py); one that
    cannot be hooked is one line, and steps end at ``monitor.step()`` instead."""
    if optimizer is None:
        return None
    found, why = optimizers.steppable(optimizer)
    if found is None:
        announce(
            f"watch(optimizer=...): {why}; its step cannot be hooked, so steps end at "
            "monitor.step() (anomalies are judged there, after the update)"
        )
    return found


def _config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    source = "config"
    if isinstance(config, (str, os.PathLike)):
        source = f"config file {config}"
        config = read_yaml(Path(config))
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping or a YAML file path, got {type(config).__name__}"
        )
    unknown = set(config) - {"rules", "defaults", "check_every", "expect", "snapshot_dir"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}")
    settings = dict(config)
    _check_types(source, settings)
    return settings


def _check_types(source: str, settings: dict[str, Any]) -> None:
    """Strict types, one line naming the field and the value (never a traceback later)."""
    if "defaults" in settings:
        strict_bool(source, "defaults", settings["defaults"])
    expect = settings.get("expect", {})
    if not isinstance(expect, Mapping) or not all(isinstance(k, str) for k in expect):
        raise ConfigError(
            f"{source}: field 'expect': expected a mapping like {{'encoder': 'B,T,256'}}, "
            f"got {expect!r}"
        )
    folder = settings.get("snapshot_dir")
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"{source}: field 'snapshot_dir': expected a folder path, got {folder!r}")


def _merge_rules(settings: dict[str, Any], rules: Any, expect: Mapping[str, Any]) -> list[Rule]:
    """Defaults, then the config's rules, then ``rules=``; ``expect`` adds shape rules."""
    defaults = settings.get("defaults", True)
    merged = load_rules(settings.get("rules"), rules, defaults=defaults)
    for i, (glob, shape) in enumerate(expect.items()):
        spec = {"name": f"shape:{glob}", "check": "shape", "modules": glob, "expect": shape}
        merged.append(parse_rule(spec, i))
    return merged


class Monitor:
    """Hooks on one model: :meth:`step` once per step, then :attr:`anomalies`; :meth:`close`."""

    def __init__(
        self,
        model: Any,
        rules: list[Rule],
        *,
        check_every: int = 1,
        optimizer: Any = None,
        ctx: ActionContext | None = None,
        enabled: bool = True,
    ) -> None:
        self.model = model
        self.rules = rules
        self.check_every = check_every
        self.enabled = enabled
        self.anomalies: list[Anomaly] = []
        self.step_count = 0
        self.reads = 0
        self._errors = 0
        self.shapes: dict[str, Shapes] = {}
        self._ctx = ctx or ActionContext(model=model, snapshot_dir=Path("breakpod-snapshots"))
        self._ctx.monitor = self
        self._handles: list[Any] = []
        # leaf input -> its gradient hook (a learned input outlives the monitor)
        self._leaf_hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        number = next(_MONITOR_IDS)
        # attributes marking the tensors this monitor checked (see _claim, _first_claim)
        self._fwd_marks = (f"_breakpod_fwd{number}", f"_breakpod_pass{number}")
        self._bwd_mark = f"_breakpod_bwd{number}"
        self._current = self._record(0)
        self._pending: list[StepRecord] = []
        self._inflight: list[tuple[list[Any], dict[Any, Any], list[StepRecord]]] = []
        self._host_buffers = HostBuffers()  # the reads' pinned copies, reused (CUDA only)
        self._backward_queued = False
        self._optimizer = optimizer
        self._urgent = any(r.urgent for r in rules)
        # the optimizer ended a step and no training pass ran since: a loss given now is
        # that step's (see record_loss)
        self._updated = False
        self._probe: list[tuple[Any, int]] = []  # (parameter, its version) at the backward
        self.skipped_steps = 0
        self._module_checks = False  # some forward/backward hook records stats
        self._said_compiled = False
        self._said_bad_loss = False
        self._shape_active: set[tuple[str, str]] = set()
        self._shape_names: dict[tuple[str, str], dict[str, int]] = {}
        self._failed: set[str] = set()
        self.capture: Capture | None = None  # timetravel: set by start_capture()
        self.flight: FlightRecorder | None = None  # the last steps on the device (flight.py)
        if enabled:
            previous = monitor_of(model)
            if previous is not None:  # two monitors would double every hook and report
                announce("watch(): this model was already watched; closing the previous monitor")
                previous.close()
            self._install(optimizer)
            MONITORS[model] = weakref.ref(self)

    # ------------------------------------------------------------------ timetravel (replay.py)
    def start_capture(self, wanted: bool | None = None) -> None:
        """Keep each step's root inputs, RNG and output gradient for ``replay``/``whatif``."""
        if self.enabled and capture_wanted(wanted, any(r.parks for r in self.rules)):
            self.capture = Capture(self.model, lambda: self.step_count)

    def replay(self) -> Any:
        """Re-run the last captured step under op instrumentation; see ``replay.py``."""
        from breakpod._monitor import replay

        report = replay.replay(self.model, self.capture)
        said = [a for a in self.anomalies if a.step == report.step and a.phase == "loss"]
        if said and not math.isfinite(said[-1].value):  # the loss itself: outside the replay
            report.loss = f"step {report.step}: {said[-1].summary}"
        return report

    # ------------------------------------------------------------------ setup
    def _rules_for(
        self, checks_: Sequence[str], name: str, module: Any, where: str | None = None
    ) -> frozenset[str]:
        names = frozenset(
            r.name
            for r in self.rules
            if r.check in checks_
            and (where is None or r.check != "nonfinite" or _nonfinite_applies(r, where, module))
            and r.matches(name, module)
        )
        return self._shared(names)

    def _shared(self, names: frozenset[str]) -> frozenset[str]:
        """One object per distinct set of rule names, not one per module (hundreds)."""
        return self._rule_sets.setdefault(names, names)

    def _install(self, optimizer: Any) -> None:
        steps = flight_steps()
        self._flight_columns = steps > 0
        batchnorm: dict[str, frozenset[str]] = {}
        self._bn_modules: list[tuple[str, Any]] = []
        self._slots: list[Slot] = []
        self._rule_sets: dict[frozenset[str], frozenset[str]] = {}  # see _shared
        for name, module in self.model.named_modules():
            self._watch_module(name, module)
            bn = self._rules_for(("batchnorm",), name, module)
            if bn and getattr(module, "running_var", None) is not None:
                batchnorm[name] = bn
                self._bn_modules.append((name, module))
        self._plan_params()
        self._install_input_hook()
        self._table = SlotTable(self._slots)
        self._stager = staging.Stager(self._table)
        self.flight = FlightRecorder(self._slots, steps) if steps else None
        self._install_grad_hooks()
        if optimizer is not None:  # before the update, so a bad step can still be dropped
            hook = self._guarded("optimizer step hook", self._before_update)
            self._handles.append(optimizer.register_step_pre_hook(hook))
        self._batchnorm = batchnorm
        self._detector = Detector(
            self.rules, [info for info, _ in self._params], batchnorm, self._norm_source
        )

    def _plan_params(self) -> None:
        """The watched parameters and how their norms, and their gradients', are taken."""
        self._params = self._watched_params()
        state = [
            (i, p) for i, (info, p) in enumerate(self._params) if _watches_params(info, self.rules)
        ]
        self._grad_norms = NormPlan([p for _, p in self._params])
        self._param_norms = NormPlan([p for _, p in state], keys=[i for i, _ in state])
        self._state_params = [p for _, p in state]
        self._missing_grads = 0  # watched parameters without a gradient at the last backward
        self._grad_reads = 0  # gradient collections since
        # built on the meta device: no values until to_empty() replaces them
        self._on_meta = any(p.is_meta for _, p in self._params)

    def _replaced_params(self, grads: list[Any]) -> bool:
        """Were parameters replaced since they were planned (``load_state_dict(assign=True)``,
        ``to_empty()`` after building on the meta device)? The old ones stop getting
        gradients, so this looks when more of them than before have none, and every
        :data:`REPLACED_EVERY` collections in case that came when none had any."""
        grew = False
        if self._current.grads_done:  # a step without a backward (evaluation) says nothing
            missing = sum(g is None for g in grads)
            grew, self._missing_grads = missing > self._missing_grads, missing
        self._grad_reads += 1
        if not (grew or self._on_meta) and self._grad_reads % REPLACED_EVERY:
            return False
        now = dict(self.model.named_parameters())
        return any(now.get(info.name) is not p for info, p in self._params)

    def _replan_params(self) -> None:
        """Plan for the parameters the model holds now; the detector keeps its baselines
        when they go by the same names."""
        before = [info for info, _ in self._params]
        self._plan_params()
        infos = [info for info, _ in self._params]
        if infos != before:
            self._detector = Detector(self.rules, infos, self._batchnorm, self._norm_source)

    def _norm_source(self, phase: str, step: int, index: int) -> Any:
        """The tensor behind a non-finite norm, to tell NaN/Inf from an overflow: the
        parameter, or its gradient while it is still that step's (judged at its own
        boundary, before another backward)."""
        _, param = self._params[index]
        if phase == "param":
            return param
        fresh = step == self.step_count - 1 and not self._current.grads_done
        return param.grad if fresh else None

    def _watched_params(self) -> list[tuple[ParamInfo, Any]]:
        """Parameters whose owning module some gradient or parameter rule watches."""
        watched = []
        for name, param in self.model.named_parameters():
            owner = name.rpartition(".")[0]
            module = self.model.get_submodule(owner)
            rules = self._shared(
                self._rules_for(("grad_norm",), owner, module)
                | self._rules_for(("nonfinite",), owner, module, "param-gradient")
                | self._rules_for(("nonfinite",), owner, module, "param")
            )
            if rules:
                watched.append((ParamInfo(name, owner, rules), param))
        return watched

    def _watch_module(self, name: str, module: Any) -> None:
        fwd = self._rules_for(ACTIVATION_CHECKS, name, module, "activation")
        bwd = self._rules_for(("nonfinite",), name, module, "gradient")
        shapes = [
            (r, r["expect"]) for r in self.rules if r.check == "shape" and r.matches(name, module)
        ]
        if not (fwd or bwd or shapes):  # shapes only (host metadata), for ``tshape``
            hook = self._guarded("shape hook", functools.partial(self._record_shapes, name))
            self._handles.append(module.register_forward_hook(hook))
            return
        self._module_checks = True
        by_name = {r.name: r for r in self.rules}
        watched = [by_name[n] for n in fwd]
        slot = back = None
        if fwd:
            slot = self._new_slot(
                name,
                "forward",
                fwd,
                total=any(r.check == "nonfinite" for r in watched),
                mean_abs=any(r.check == "activation" for r in watched),
                zeros=any(r.check == "dead_units" for r in watched),
                pre_relu=any(r.check == "dead_units" and r["pre_relu"] for r in watched),
                retain=any(r.parks for r in watched),
                abs_limit=min(
                    (r["max_mean_abs"] for r in watched if r.check == "activation"),
                    default=math.inf,
                ),
                zero_limit=min(
                    (r["max_zero_fraction"] for r in watched if r.check == "dead_units"),
                    default=math.inf,
                ),
            )
        if bwd:
            back = self._new_slot(name, "backward", bwd, retain=any(by_name[n].parks for n in bwd))
        hook = self._forward_hook(name, module, slot, back, shapes)
        # with the call's keyword arguments: a module called as layer(hidden_states=h) has
        # its input there
        self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def _new_slot(self, name: str, phase: str, rules: frozenset[str], **flags: Any) -> Slot:
        """A slot with its columns after the previous slots' in the per-step buffer."""
        base = sum(s.width for s in self._slots)
        index, flight = len(self._slots), self._flight_columns
        slot = Slot(name, phase, rules, index=index, base=base, flight=flight, **flags)
        self._slots.append(slot)
        return slot

    def _install_input_hook(self) -> None:
        """A pre-hook on the model: the batch is checked (a non-finite batch is the data's
        fault, not the first module's), and a no_grad pass never mixes into a training step."""
        import torch

        self._grad_enabled = torch.is_grad_enabled
        self._pass = 0  # forward passes of the model so far (see _claim)
        self._aside = False  # this pass runs inside a torch.func transform (_in_transform)
        self._tensor = torch.Tensor
        self._strided = torch.strided
        # dtypes the statistics read as they are (all others: checks.as_float32)
        self._native = frozenset((torch.float32, torch.bfloat16, torch.float16))
        self._ignore_pass = False
        self._input_slot: Slot | None = None
        if self._module_checks:
            self._plan_input_slot()
        # always: a training pass is where a step begins (see record_loss)
        hook = self._guarded("model input hook", self._on_model_input)
        self._handles.append(self.model.register_forward_pre_hook(hook))

    def _plan_input_slot(self) -> None:
        batch_rules = frozenset(
            r.name
            for r in self.rules
            if r.check == "nonfinite"
            and "activation" in r["where"]
            and any(r.name in s.rules for s in self._slots if s.phase == "forward")
        )
        if batch_rules:
            parks = any(r.parks for r in self.rules if r.name in batch_rules)
            self._input_slot = self._new_slot("", "input", batch_rules, retain=parks)

    def _on_model_input(self, module: Any, inputs: tuple[Any, ...]) -> None:
        self._pass += 1  # a claim holds for one pass: a module may return one tensor each step
        if self._grad_enabled():
            self._updated = False  # a training pass: the next step has begun (see record_loss)
        if not self._module_checks:
            return
        self._aside = _in_transform()  # the module hooks do nothing in this pass
        if self._aside:
            return
        self._sort_pass(self._current)
        slot = self._input_slot
        # the first tensor only: a later argument may hold -inf by design (an attention mask)
        x = checks.first_tensor(inputs) if slot is not None and not self._ignore_pass else None
        if slot is not None and x is not None and (x.is_floating_point() or x.is_complex()):
            self._write_stats(slot, x.detach())

    def _sort_pass(self, record: StepRecord) -> None:
        """Evaluation under no_grad is not the training step: a training pass drops the
        stats of an evaluation pass before it, and an evaluation pass after training
        stats in the same step records nothing. Only no_grad passes (inference) count."""
        if self._grad_enabled():
            self._ignore_pass = False
            if record.eval_only:
                self._stager.drop()
                record.ran.clear()
                record.units.clear()
                record.kept.clear()
                record.eval_only = False
        elif not record.ran:
            self._ignore_pass, record.eval_only = False, True
        else:
            self._ignore_pass = not record.eval_only

    def _install_grad_hooks(self) -> None:
        """One hook on the model's output queues the end-of-backward gradient norms.

        (The model's output gradient is the first one a backward computes.) When
        no backward passes through it, :meth:`step` collects the norms instead.
        """
        if self._params:
            hook = self._guarded("model output hook", self._on_model_output)
            self._handles.append(self.model.register_forward_hook(hook))
        self._on_output_grad = self._guarded("output gradient hook", self._queue_backward_end)
        self._backward_end = self._guarded("gradient norms", self._on_backward_end)

    def _on_model_output(self, module: Any, inputs: Any, output: Any) -> None:
        if self._aside:  # the pass inside a transform ends here: later calls are checked
            self._aside = False
            return
        out = checks.first_tensor(output)
        if out is not None and out.requires_grad:
            out.register_hook(self._on_output_grad)  # type: ignore[no-untyped-call]

    def _guarded(self, where: str, fn: Callable[..., None]) -> Callable[..., None]:
        """Wrap a hook: a failure is reported once and swallowed; only ``stop`` raises."""

        compiling = _is_compiling()

        def hook(*args: Any) -> None:
            if compiling():  # dynamo would trace the hook's tensor marks and fail: skip it
                return
            if replaying():  # timetravel: a replayed step is not a new step
                return
            try:
                fn(*args)
            except AnomalyError:
                raise
            except Exception as e:
                self._fail(where, e)

        return hook

    def _before_update(self, optimizer: Any, *_: Any) -> None:
        """The optimizer's step pre-hook ends the step: checks run before the update."""
        frame = _user_frame(sys._getframe())
        self._end_step(None, frame)
        self._updated = True
        boundary.boundary(self.step_count, frame, now=True)  # a `break`: before the update

    # ------------------------------------------------------------------ hooks (hot path)
    # A forward hook runs for every watched module in every step and a gradient hook for
    # every watched input in every backward; on a CPU a model of hundreds of small modules
    # pays their Python on each call. So each hook is one closure with its module's state
    # bound at install: no partials, no per-call tuples or closures, few lookups on self.
    # Nor do they keep new objects past the call (the shapes are stored only when they
    # change): objects that outlive a step's collections of the young generation die
    # old, and enough of them bring on a full collection, a pass over every object of
    # a process that imported torch (200 ms and more).
    def _forward_hook(
        self,
        name: str,
        module: Any,
        slot: Slot | None,
        back: Slot | None,
        shapes: list[tuple[Rule, Any]],
    ) -> Callable[..., None]:
        import torch

        tensor_type = torch.Tensor
        # outputs >= 0 (or NaN) by construction: dead units take one cheap max (checks.py)
        nonnegative = type(module) in (torch.nn.ReLU, torch.nn.ReLU6)
        mode = staging.unit_mode(slot, nonnegative) if slot is not None else ""
        # SiLU(inplace=True) and the like: they change their input and return it (dropout
        # need not: in evaluation, or with p=0, it returns its input untouched)
        inplace = getattr(module, "inplace", False) is True and not isinstance(
            module, torch.nn.modules.dropout._DropoutNd
        )
        # output index -> node pre-hook (-1: the tensor hook of a leaf input)
        grad_hooks: dict[int, Callable[[Any], None]] = {}
        seen = self.shapes
        fwd_marks = self._fwd_marks
        compiling = _is_compiling()

        def hook(module: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if compiling() or REPLAYING[0] or self._aside:  # see _guarded, _in_transform
                return
            try:
                out = output if isinstance(output, tensor_type) else checks.first_tensor(output)
                if out is None:
                    return
                try:
                    now: Shapes = (
                        [x.shape for x in inputs if isinstance(x, tensor_type)],
                        out.shape,
                    )
                except RuntimeError:  # a nested tensor has no one shape
                    now = _shapes(inputs, out)
                if seen.get(name) != now:  # kept only on a change: see the note above
                    seen[name] = now
                if shapes and not out.is_nested:  # a contract names one size per dim
                    for rule, contract in shapes:
                        self._check_shape(name, rule, contract, out)
                if self._ignore_pass:
                    return  # an evaluation pass inside a training step
                if slot is not None:
                    # the module's first value: (mask, y) is judged on y
                    value = (
                        out
                        if out.is_floating_point() or out.is_complex()
                        else checks.first_tensor(output, values_only=True)
                    )
                    if value is not None and _claim(value, fwd_marks, name, self._pass):
                        # the value, not the graph
                        self._write_stats(slot, value.detach(), nonnegative, mode)
                if back is not None:
                    changed = out if inplace else None
                    self._hook_inputs(name, back, grad_hooks, inputs, changed)
                    if kwargs:
                        self._hook_inputs(name, back, grad_hooks, kwargs.values(), changed)
            except AnomalyError:
                raise
            except Exception as e:
                self._fail("forward hook", e)

        return hook

    def _grad_hook(self, slot: Slot, index: int) -> Callable[[Any], None]:
        """The hook that checks the gradient w.r.t. a module's input (see _forward_hook):
        a node pre-hook given the node's output gradients, of which it takes ``index``,
        or, with ``index`` -1, a tensor hook given the gradient itself."""
        compiling = _is_compiling()

        def hook(grads: Any) -> None:
            # closed: a tensor hook on a leaf (a parameter fed as an input) outlives close()
            if compiling() or REPLAYING[0] or not self.enabled:
                return
            grad = grads if index < 0 else grads[index]
            if grad is None:  # an output no loss depends on has no gradient
                return
            try:
                self._write_stats(slot, grad.detach())
                if not self._backward_queued:
                    self._queue_backward_end()
            except AnomalyError:
                raise
            except Exception as e:
                self._fail("gradient hook", e)

        return hook

    def _record_shapes(self, name: str, module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        """Remember the last input/output shapes; returns the output tensor (or None)."""
        out = checks.first_tensor(output)
        if out is not None:
            self.shapes[name] = _shapes(inputs, out)
        return out

    def _write_stats(self, slot: Slot, x: Any, nonnegative: bool = False, mode: str = "") -> None:
        """The slot's statistics into this step's buffer; the host notes that it ran.

        ``mode``: :func:`.staging.unit_mode` of the slot (made once per hook, not per call).
        """
        if x.layout is not self._strided or x.is_nested or x.is_meta:
            x = checks.dense_values(x)  # sparse, nested, mkldnn: their values; meta: none
            if x is None:
                return
        numel = x.numel()
        if not numel:
            return  # an empty batch's tensor: no value to check
        if x.dtype not in self._native:  # float64, float8, complex: see checks.as_float32
            x = checks.as_float32(x)
            numel = x.numel()
        if slot.retain:  # as the statistics saw it: its exact counts must agree with them
            self._current.kept[slot.index] = x
        record, device = self._current, x.device
        ran = record.ran.get(device)
        index = slot.index
        if ran is not None and index in ran:  # a second call this step: the sums add
            self._add_stats(record, device, slot, x, nonnegative)
            return
        staged = self._stager.put(slot, x, mode, device, numel, not record.stats)
        if not staged:  # a large tensor: at once
            cells = self._table.cells(device)
            checks.write_stats(
                x, cells, slot.base, *slot.flags, nonnegative=nonnegative, stats=record.stats
            )
        if ran is None:  # noted once its statistics are written: a failure leaves no trace
            ran = record.ran[device] = {}
            record.units[device] = {}
        ran[index] = numel
        if slot.zeros and record.stats:
            record.units[device][index] = checks.unit_count(x.shape)

    def _add_stats(
        self, record: StepRecord, device: Any, slot: Slot, x: Any, nonnegative: bool
    ) -> None:
        scratch = x.new_zeros(slot.width, dtype=_float32())
        stats = record.stats
        checks.write_stats(
            x, scratch.unbind(), 0, *slot.flags, nonnegative=nonnegative, stats=stats
        )
        self._stager.add(device, slot, scratch)
        record.ran[device][slot.index] += x.numel()
        if slot.zeros and stats:
            record.units[device][slot.index] += checks.unit_count(x.shape)

    def _hook_inputs(
        self,
        name: str,
        slot: Slot,
        grad_hooks: dict[int, Callable[[Any], None]],
        inputs: Iterable[Any],
        changed: Any,
    ) -> None:
        """The gradient w.r.t. a module's input is what its backward produced: check it there.

        A pre-hook on the node that produced the input sees that gradient (all
        consumers' sum, as a tensor hook would) for about half the cost of
        ``Tensor.register_hook``; a leaf input has no node, so it gets a tensor hook.
        The hooks are made once per module and output index, not per call. An
        in-place module (``SiLU(inplace=True)``) returns its input, ``changed``, whose
        node is now the module's own: the input's producer is that node's first next
        function.
        """
        if not self._grad_enabled():
            return
        for x in inputs:
            if not (isinstance(x, self._tensor) and x.requires_grad):
                continue
            node = x.grad_fn
            if x is changed and node is not None and node.next_functions:
                # the producer before the change; x itself is the module's output, left
                # unclaimed for the module that reads it next
                node, index = node.next_functions[0]
                if node is None:  # the input needed no gradient before the change
                    continue
            elif _first_claim(x, self._bwd_mark, name):
                index = -1 if node is None else x.output_nr
            else:
                continue
            hook = grad_hooks.get(index)
            if hook is None:
                hook = grad_hooks[index] = self._grad_hook(slot, index)
            if node is None:  # a leaf keeps its hook across steps: removed by close()
                self._leaf_hooks[x] = x.register_hook(hook)
            else:
                node.register_prehook(hook)

    def _queue_backward_end(self, *_: Any) -> None:
        if self._backward_queued or not self._params:
            return
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(self._backward_end)
        self._backward_queued = True

    def _on_backward_end(self) -> None:
        self._backward_queued = False
        self._updated = False  # a backward after the update: the next step has begun
        self._current.grads_done = True
        self._collect_grads()

    def _collect_grads(self) -> None:
        """The norms of every watched gradient (``NormPlan``); a later backward in the step
        replaces them."""
        entries = [e for e in self._current.entries if e.kind != "grads"]
        grads = [p.grad for _, p in self._params]
        if self._replaced_params(grads):
            self._replan_params()
            grads = [p.grad for _, p in self._params]
        for _, keys, norms in self._grad_norms(grads):
            entries.append(Entry("grads", norms, keys=keys))
        self._current.entries = entries
        if self._optimizer is None:  # to tell, at a skip, whether an update came since
            present = (p for g, (_, p) in zip(grads, self._params, strict=True) if g is not None)
            self._probe = [(p, p._version) for p in itertools.islice(present, PROBED)]

    def _check_shape(self, name: str, rule: Rule, contract: checks.ShapeContract, out: Any) -> None:
        key = (rule.name, name)
        carried = self._shape_names.setdefault(key, {})  # names keep their size across steps
        shape = tuple(out.shape)
        why = contract.mismatch(shape) or contract.carried_mismatch(shape, carried)
        if why is None:
            carried.update(contract.names(shape))
            self._shape_active.discard(key)
            return
        if key in self._shape_active:
            return
        self._shape_active.add(key)
        summary = f"output shape {list(out.shape)} breaks the contract {contract.text}: {why}"
        details = {"expected": contract.text, "actual": list(out.shape)}
        value = float(out.dim())
        anomaly = Anomaly(rule.name, "shape", name, self.step_count, "forward", summary, value)
        anomaly.details, anomaly.tensor = details, out.detach()
        self._report([(anomaly, rule)], _user_frame(sys._getframe()))

    # ------------------------------------------------------------------ step boundary
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

    def _end_step(self, loss: Any, frame: FrameType | None = None) -> None:
        if loss is not None:
            self._put_loss(loss)
        if not self._current.grads_done and self._params:
            self._collect_grads()  # no backward ran through the model's output hook
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
        elif self.step_count % self.check_every == 0 or done.kept:
            self._read(done)  # kept tensors (break/snapshot rules) live one step, not check_every
        self._evaluate_landed(wait=False)

    def _record(self, step: int) -> StepRecord:
        """A new step's record. Activation statistics (mean |x|, dead units) are slow
        conditions: they are measured on the steps that end with a read, every
        ``check_every``; non-finite values, on every step."""
        return StepRecord(step, stats=(step + 1) % self.check_every == 0)

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
        """Drop this step's update: no gradient, so the optimizer's step changes nothing."""
        if not self._ctx.take_skip(step):
            return
        if any(p._version != version for p, version in self._probe):
            announce(
                f"step {step}: update not skipped: optimizer.step() ran before monitor.step(), "
                "so it was applied before the verdict (call monitor.step(loss) before "
                "optimizer.step(), or pass watch(optimizer=...))"
            )
            return
        params = _optimizer_params(self._optimizer) or list(self.model.parameters())
        for p in params:
            p.grad = None  # optimizers leave a parameter without a gradient untouched
        self.skipped_steps += 1
        for anomaly in self.anomalies:
            if anomaly.step == step:
                anomaly.skipped = True
        announce(f"step {step}: update skipped (gradients dropped before the optimizer step)")

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

    def _add_state_checks(self, step: StepRecord) -> None:
        """Parameters and BatchNorm buffers persist, so they are checked only at reads."""
        if self._state_params and not self._on_meta:
            for _, keys, norms in self._param_norms(self._state_params):
                step.entries.append(Entry("params", norms, keys=keys))
        for _, group in by_device(self._bn_modules, lambda item: item[1].running_var).items():
            step.entries.append(
                Entry(
                    "batchnorm",
                    checks.batchnorm_stats([m for _, m in group]),
                    keys=[n for n, _ in group],
                )
            )

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
        from torch.autograd.profiler import record_function

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
            # exporters (breakpod.export): host floats already read, before a stop can raise
            events.emit_local(
                events.STEP_STATS,
                monitor=self,
                steps=[data],
                params=self._detector.params,
                read_done=i == len(steps) - 1,
            )
            self._report(self._detector.run(data), frame)

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

    # ------------------------------------------------------------------ lifecycle
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

    def close(self) -> None:
        """Read what is still pending (the last steps' statistics, a loss recorded after
        the optimizer's step), then remove every hook; the anomalies stay for inspection."""
        if self.enabled and self._pending:  # else the exporters never hear the last step
            with contextlib.suppress(AnomalyError):  # a stop rule: training is over anyway
                self.flush()
        for handle in [*self._handles, *self._leaf_hooks.values()]:
            handle.remove()
        self._handles.clear()
        self._leaf_hooks.clear()
        if self.capture is not None:  # timetravel
            self.capture.close()
        if self.flight is not None:
            self.flight.close()
        self._pending, self._inflight, self._current = [], [], self._record(self.step_count)
        self.enabled = False
        if monitor_of(self.model) is self:
            MONITORS.pop(self.model, None)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


def _shapes(inputs: tuple[Any, ...], out: Any) -> Shapes:
    """The input and output shapes, nested tensors' too (see :func:`.checks.shape_of`)."""
    import torch

    ins = [checks.shape_of(x) for x in inputs if isinstance(x, torch.Tensor)]
    return ins, checks.shape_of(out)


def _is_compiling() -> Callable[[], bool]:
    """True inside a torch.compile trace (constant there, so the hook traces to nothing);
    looked up once per hook, not per call."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return check if check is not None else _never


def _in_transform() -> bool:
    """Inside a torch.func transform (``vmap``, ``grad``, ``jacrev``)? They refuse the
    hooks' writes into the step's buffers, and their tensors are not the step's. Asked
    once per pass of the model, not per module."""
    functorch = getattr(sys.modules["torch"]._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _never() -> bool:
    return False


def _optimizer_params(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    return [p for group in optimizer.param_groups for p in group["params"]]


def _float32() -> Any:
    import torch

    return torch.float32


def _nonfinite_applies(rule: Rule, where: str, module: Any) -> bool:
    """``skip_types`` spares pass-through modules' tensors, never parameters or their grads."""
    if where == "param-gradient":
        return "gradient" in rule["where"]
    if where not in rule["where"]:
        return False
    return where in ("param", "loss") or type(module).__name__ not in rule["skip_types"]


def _claim(tensor: Any, marks: tuple[str, str], name: str, pass_: int) -> bool:
    """Check a tensor once a pass: a container skips what one of its submodules already
    took in this forward pass.

    The marks (the module's name, the pass) are attributes on the tensor object, so
    they live exactly as long as the tensor (an id() table could confuse a freed
    tensor with a new one). Two plain values, not a tuple: a tuple a call is an object
    the garbage collector tracks, made for every module in every step.
    """
    owner_attr, pass_attr = marks
    marked = tensor.__dict__
    owner = marked.get(owner_attr)
    taken = owner is not None and marked[pass_attr] == pass_  # in this pass
    if taken and (name == "" or owner == name or owner.startswith(name + ".")):
        return False
    marked[owner_attr], marked[pass_attr] = name, pass_
    return True


def _first_claim(tensor: Any, attr: str, name: str) -> bool:
    """One gradient hook per tensor: its gradient is the same whichever consumer hooks it."""
    if attr in tensor.__dict__:
        return False
    setattr(tensor, attr, name)
    return True


def _watches_params(info: ParamInfo, rules: list[Rule]) -> bool:
    return any(
        r.name in info.rules and r.check == "nonfinite" and "param" in r["where"] for r in rules
    )


__all__ = ["Monitor", "RuleError", "monitor_enabled", "watch"]
