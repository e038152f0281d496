"""What a monitor holds: one declaration of the state its parts share.

A :class:`~breakpod._monitor.monitor.Monitor` is built from parts, each a class of
its own over the one below it (reporting < parameter planning < module hooks <
step pipeline < monitor), all on one object: a hook on the hot path reads the
step's record as one attribute, not through a chain of objects. Each part sets
what it owns; the types are declared here once, so each part reads the others'
state typed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from breakpod._monitor.anomaly import ActionContext, Anomaly
from breakpod._monitor.detect import Detector, ParamInfo, Slot
from breakpod._monitor.flight.recorder import FlightRecorder
from breakpod._monitor.gate import UpdateGate
from breakpod._monitor.norms import NormPlan
from breakpod._monitor.peers import Departures, Peers
from breakpod._monitor.root_hooks import RootHooks
from breakpod._monitor.rules import Rule
from breakpod._monitor.scaling import LossScaling
from breakpod._monitor.sharding import ShardedNorms
from breakpod._monitor.staging import Stager
from breakpod._monitor.stats import HostBuffers, SlotTable, StepRecord
from breakpod._monitor.timetravel.capture import Capture

Shapes = tuple[list[tuple[int, ...]], tuple[int, ...]]  # a module's input and output shapes


class MonitorState:
    """The attributes of a monitor, by the part that sets them."""

    # the monitor (monitor.py): what it watches and its public counters
    model: Any
    tier: str  # sentinel | detailed (tiers.py)
    _is_probe: bool  # a detailed copy for a replay (sentinel.py)
    _sees_replay: bool  # its hooks run while a replay runs
    rules: list[Rule]
    check_every: int
    enabled: bool
    anomalies: list[Anomaly]
    step_count: int
    reads: int
    skipped_steps: int
    shapes: dict[str, Shapes]
    capture: Capture | None
    _root: RootHooks  # the model's own call: its hooks, compiled or not (root_hooks.py)
    flight: FlightRecorder | None
    _ctx: ActionContext
    _optimizer: Any
    _gate: UpdateGate | None  # a fused optimizer: NaN/Inf updates skipped on the device
    _handles: list[Any]
    _leaf_hooks: weakref.WeakKeyDictionary[Any, Any]
    _flight_columns: bool
    _batchnorm: dict[str, frozenset[str]]
    _bn_modules: list[tuple[str, Any]]
    _detector: Detector
    _table: SlotTable
    _stager: Stager
    # reporting (reporting.py)
    _errors: int
    _failed: set[str]
    _said_compiled: bool
    # parameter planning (params.py)
    _rule_sets: dict[frozenset[str], frozenset[str]]
    _params: list[tuple[ParamInfo, Any]]
    _grad_norms: NormPlan
    _param_norms: NormPlan
    _state_params: list[Any]
    _sharding: ShardedNorms | None  # FSDP: the gradient norms summed over the ranks
    _sharded: bool  # FSDP, whether or not the norms can be summed
    _peers: Peers | None  # the ranks a skip is agreed with (DDP, FSDP)
    _decided: int  # updates whose skip was decided (with the peers, if any)
    _loop_skipped: bool  # the step ending is one whose update the loop skipped
    _closing: bool  # closed while its peers still sum its norms (monitor._stays_for_peers)
    _said_closing: bool
    _departures: Departures | None  # where closed monitors make their last agreements
    _peers_unknown: bool  # a skipping monitor without peers yet: DDP may wrap the model
    _bn_slow: bool  # BatchNorm's statistics read once in SLOW_STEPS steps (the sentinel's rule)
    _bn_read: int
    _missing_grads: int
    _grad_reads: int
    _on_meta: bool
    _probe: list[tuple[Any, int]]
    _grad_seen: tuple[Any, weakref.ref[Any], int] | None  # a parameter, its gradient, its version
    _zeroed: bool  # that gradient was written between two backwards (zeroed in place)
    _scale_seen: int | None  # the GradScaler's update() count at the last backward
    # module hooks (hooks.py)
    _slots: list[Slot]
    _module_checks: bool
    _fwd_marks: tuple[str, str]
    _bwd_mark: str
    _input_slot: Slot | None
    _ignore_pass: bool
    _aside: bool
    _pass: int
    _backward_queued: bool
    _grad_enabled: Callable[[], bool]
    _tensor: Any
    _strided: Any
    _native: frozenset[Any]
    _on_output_grad: Callable[..., None]
    _backward_end: Callable[..., None]
    _shape_active: set[tuple[str, str]]
    _shape_names: dict[tuple[str, str], dict[str, int]]
    # the step pipeline (pipeline.py)
    _current: StepRecord
    _pending: list[StepRecord]
    _inflight: list[tuple[list[Any], dict[Any, Any], list[StepRecord]]]
    _host_buffers: HostBuffers
    _urgent: bool
    _updated: bool
    _said_bad_loss: bool
    _scaling: LossScaling  # a GradScaler's overflows (scaling.py)
