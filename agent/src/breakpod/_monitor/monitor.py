"""``breakpod.watch(model)``: tensor monitors with no host-device sync on the hot path.

Two tiers (:mod:`~breakpod._monitor.tiers`): the sentinel, the default, hooks no
module; it judges the loss and the gradient norms at the step's end and localizes
a non-finite one by replaying the step under the detailed checks
(:mod:`~breakpod._monitor.sentinel`). The detailed tier hooks every watched module;
in the sentinel tier only a rule that reads outputs hooks, the modules it names.

How a step flows in the detailed tier:

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
import itertools
import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from breakpod._core import wiring
from breakpod._core.announce import announce
from breakpod._core.config import env_flag
from breakpod._core.errors import AnomalyError, ConfigError, RuleError
from breakpod._monitor import optimizers, staging, tiers
from breakpod._monitor.anomaly import ActionContext, Anomaly
from breakpod._monitor.compiled import apply_compile_policy, unwrap_compiled
from breakpod._monitor.detect import Detector, Slot
from breakpod._monitor.flight.recorder import FlightRecorder, flight_steps
from breakpod._monitor.gate import gate_for
from breakpod._monitor.peers import departures_in_job
from breakpod._monitor.pipeline import JUDGE_LABEL
from breakpod._monitor.root_hooks import RootHooks
from breakpod._monitor.rules import Rule, load_rules, parse_rule, read_yaml, strict_bool
from breakpod._monitor.scaling import LossScaling
from breakpod._monitor.sentinel import Sentinel
from breakpod._monitor.state import Shapes
from breakpod._monitor.stats import HostBuffers, SlotTable, StepRecord
from breakpod._monitor.timetravel.capture import Capture, capture_wanted

log = logging.getLogger(__name__)

# Each monitor marks the tensors it checked with attributes of its own, so that a later
# monitor (watch() again, another model sharing a module) is not kept off them.
_MONITOR_IDS = itertools.count()
# model -> its monitor. Weak both ways: the monitor holds the model, so a strong
# value would keep every watched model (and its hooks) alive forever.
MONITORS: weakref.WeakKeyDictionary[Any, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()


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
    tier: str | None = None,  # sentinel (default) or detailed: see tiers.py
) -> Monitor:
    """Watch ``model`` with the default rules plus ``rules``; see the README's "Tensor monitors".

    ``config`` is a mapping or YAML file with any of ``rules``, ``defaults``,
    ``check_every``, ``expect``, ``snapshot_dir`` and ``tier``; explicit arguments win.
    With ``BREAKPOD_MONITOR=0`` (or ``AI_DEBUG_MODE=0``) nothing is installed.
    """
    _check_arguments(model, optimizer, expect)
    optimizer = _hooked_optimizer(optimizer)
    settings = _config(config)
    every = check_every if check_every is not None else settings.get("check_every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"check_every={every!r}: expected a positive integer (1 = every step)")
    tier = tiers.tier_of(tier if tier is not None else settings.get("tier"))
    expected = {**settings.get("expect", {}), **(expect or {})}
    merged = _merge_rules(settings, rules, expected, detailed=tier == tiers.DETAILED)
    apply_compile_policy()  # explicit in the environment, so honoured even when disabled
    enabled = monitor_enabled()
    if enabled:
        model = unwrap_compiled(model, detailed=tier == tiers.DETAILED)
        wiring.connect()  # anomaly events and broker commands, when a broker is set
    folder = Path(snapshot_dir or settings.get("snapshot_dir") or "breakpod-snapshots")
    ctx = ActionContext(model=model, snapshot_dir=folder, sink=sink)
    return Monitor(
        model,
        merged,
        check_every=every,
        optimizer=optimizer,
        ctx=ctx,
        enabled=enabled,
        tier=tier,
        replay=replay,
    )


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
    unknown = set(config) - {"rules", "defaults", "check_every", "expect", "snapshot_dir", "tier"}
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


def _merge_rules(
    settings: dict[str, Any], rules: Any, expect: Mapping[str, Any], *, detailed: bool
) -> list[Rule]:
    """Defaults, then the config's rules, then ``rules=``; ``expect`` adds shape rules."""
    defaults = settings.get("defaults", True)
    merged = load_rules(settings.get("rules"), rules, defaults=defaults, detailed=detailed)
    for i, (glob, shape) in enumerate(expect.items()):
        spec = {"name": f"shape:{glob}", "check": "shape", "modules": glob, "expect": shape}
        merged.append(parse_rule(spec, i))
    return merged


CLOSE_WAIT = 5.0  # seconds close() waits for the other ranks' (a sharded model's monitor)


class Monitor(Sentinel):
    """Hooks on one model: :meth:`step` once per step, then :attr:`anomalies`; :meth:`close`.

    Built from its parts (see :mod:`~breakpod._monitor.state`): reporting, parameter
    planning, module hooks, the step pipeline, the sentinel's localization; this class
    installs them and owns the monitor's lifecycle and its time travel.
    """

    def __init__(
        self,
        model: Any,
        rules: list[Rule],
        *,
        check_every: int = 1,
        optimizer: Any = None,
        ctx: ActionContext | None = None,
        enabled: bool = True,
        tier: str = tiers.DETAILED,
        probe: bool = False,
        replay: bool | None = None,  # timetravel: capture for `replay`/`whatif` (capture.py)
    ) -> None:
        self.model = model
        self.tier = tier
        # a detailed copy the sentinel makes for a replay (see sentinel.py): registered
        # nowhere, reporting to its parent, its hooks awake while a replay runs
        self._is_probe = probe
        self._sees_replay = probe
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
        self._peers = None  # the ranks a skip is agreed with (peers.py)
        self._decided = 0  # updates whose skip was decided (with the peers, if any)
        self._loop_skipped = False  # the step ending is one whose update the loop skipped
        self._departures = None  # where closed monitors make their last agreements
        self._closing = False  # closed while peers still sum its norms (_stays_for_peers)
        self._said_closing = False
        # a rule that must act before the update, or the sentinel at check_every=1: its one
        # read a step waits at the step's end, so a bad step's replay comes before the update
        self._urgent = any(r.urgent for r in rules) or (
            tier == tiers.SENTINEL and check_every == 1 and not probe
        )
        # the optimizer ended a step and no training pass ran since: a loss given now is
        # that step's (see record_loss)
        self._updated = False
        self._probe: list[tuple[Any, int]] = []  # (parameter, its version) at the backward
        self._grad_seen = None
        self._zeroed = False  # the gradient seen was written between two backwards
        self._scale_seen = None
        self.skipped_steps = 0
        self._module_checks = False  # some forward/backward hook records stats
        self._said_compiled = False
        self._said_bad_loss = False
        self._scaling = LossScaling()
        self._shape_active: set[tuple[str, str]] = set()
        self._shape_names: dict[tuple[str, str], dict[str, int]] = {}
        self._failed: set[str] = set()
        self.capture: Capture | None = None  # timetravel: set by _start_capture()
        self.flight: FlightRecorder | None = None  # the last steps on the device (flight.py)
        self._start_sentinel()
        if not enabled:
            return
        previous = None if probe else monitor_of(model)
        if previous is not None:  # two monitors would double every hook and report
            announce("watch(): this model was already watched; closing the previous monitor")
            previous.close()
        self._root = RootHooks(model)
        if not probe:  # a probe replays the sentinel's capture
            self._start_capture(replay)  # first: its root hooks run before the monitor's
        self._install(optimizer)
        if not probe:
            MONITORS[model] = weakref.ref(self)

    def _start_capture(self, wanted: bool | None) -> None:
        """Keep each step's root inputs, RNG and output gradient for ``replay``/``whatif``."""
        parks = any(r.parks for r in self.rules)
        if capture_wanted(wanted, parks or self.tier == tiers.SENTINEL):
            self.capture = Capture(self._root, lambda: self.step_count)

    def replay(self) -> Any:
        """Re-run the last captured step under op instrumentation; see ``replay.py``."""
        from breakpod._monitor.timetravel import replay

        report = replay.replay(self.model, self.capture)
        said = [a for a in self.anomalies if a.step == report.step and a.phase == "loss"]
        if said and not math.isfinite(said[-1].value):  # the loss itself: outside the replay
            report.loss = f"step {report.step}: {said[-1].summary}"
        return report

    def _install(self, optimizer: Any) -> None:
        steps = 0 if self._is_probe else flight_steps()
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
        params = [(info.name, p) for info, p in self._params]
        self.flight = FlightRecorder(self._slots, steps, params) if steps else None
        self._install_grad_hooks()
        # closed monitors' last agreements with their peers come before this one's (peers.py)
        self._departures = departures_in_job(optimizer or self.model, self._is_probe)
        if optimizer is not None:  # before the update, so a bad step can still be dropped
            hook = self._guarded("optimizer step hook", self._before_update)
            self._handles.append(optimizer.register_step_pre_hook(hook))
        self._gate = None if self._is_probe else gate_for(optimizer, self.rules, self._baselines)
        if self._gate is not None:
            hook = self._guarded("optimizer step hook", self._gate.after_update)
            self._handles.append(optimizer.register_step_post_hook(hook))
            if self._gate.rules:  # their skips are the device's: no read waits for them
                self._urgent = any(r.urgent for r in self.rules if r.name not in self._gate.rules)
                self._urgent |= self.tier == tiers.SENTINEL and self.check_every == 1
        # a skip of this rank's update alone would part the replicas or shards: agreed
        self._peers = self._skip_peers()
        self._peers_unknown = self._peers is None and self._can_skip()  # see _look_for_ddp
        self._batchnorm = batchnorm
        self._detector = Detector(
            self.rules, [info for info, _ in self._params], batchnorm, self._norm_source
        )

    def close(self) -> None:
        """Read what is still pending (the last steps' statistics, a loss recorded after
        the optimizer's step), then remove every hook; the anomalies stay for inspection.
        A sharded model's monitor goes on until every rank's has closed (_stays_for_peers)."""
        if self.enabled and self._pending:  # else the exporters never hear the last step
            with contextlib.suppress(AnomalyError):  # a stop rule: training is over anyway
                self.flush()
        if self._stays_for_peers():
            return
        for handle in [*self._handles, *self._leaf_hooks.values()]:
            handle.remove()
        self._handles.clear()
        self._leaf_hooks.clear()
        if self.capture is not None:  # timetravel
            self.capture.close()
        if self.enabled:  # else it never had root hooks
            self._root.close()
        self._close_sentinel()
        if self.flight is not None:
            self.flight.close()
        self._pending, self._inflight, self._current = [], [], self._record(self.step_count)
        self.enabled = False
        self._leave_peers_later()
        if monitor_of(self.model) is self:
            MONITORS.pop(self.model, None)

    def _stays_for_peers(self) -> bool:
        """A sharded model's gradient norms are summed over the ranks at each backward: a
        rank that closed alone would leave the others waiting in that sum (a hang). So its
        monitor waits a little for the others' close, as told in the job's store, and if
        they do not come goes on until they have, closing at the end of the first backward
        after (hooks.py). Each backward runs FSDP's own collectives before that end, and
        the count is read after them, so every rank sees the same count there."""
        over = self._sharding.collectives if self.enabled and self._sharding else None
        if over is None or not over.live:
            return False
        if over.leave(now=not self._closing, wait=0.0 if self._closing else CLOSE_WAIT):
            over.disband()
            return False
        if self._closing and not self._said_closing:
            self._said_closing = True
            announce(
                "monitor: closed on this rank while other ranks still watch the sharded "
                "model, whose gradient norms are summed over the ranks at each backward: it "
                "goes on watching until every rank's monitor has closed"
            )
        self._closing = True
        return True

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["JUDGE_LABEL", "Monitor", "RuleError", "monitor_enabled", "watch"]
