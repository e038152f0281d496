"""Collective progress: how many collectives this rank entered and completed.

Installed only while stall detection runs (``install()``), never at import:
the public ``torch.distributed`` collectives are wrapped, and a DDP model gets
a counting all-reduce comm hook at its next forward (unless it has its own
hook; one the job registers later runs inside the counting one). Counting is
host-side bookkeeping, no device sync. A rank whose ``entered`` is behind the
collective its peers wait in is the one they wait for. A collective inside a
``torch.compile`` trace is not counted: the counter's lock would break the graph.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from breakpod._core.compiling import compiling_check

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)


class Progress:
    """Counters the watchdog thread reads; written by the training thread(s)."""

    def __init__(self) -> None:
        self.entered = 0
        self.completed = 0
        self.op: str | None = None  # the last collective entered
        self.changed_at = time.monotonic()  # the last enter or leave: progress
        self._lock = threading.Lock()

    def enter(self, op: str) -> None:
        with self._lock:
            self.entered += 1
            self.op = op
            self.changed_at = time.monotonic()

    def leave(self) -> None:
        with self._lock:
            self.completed += 1
            self.changed_at = time.monotonic()

    @property
    def waiting(self) -> bool:
        return self.entered > self.completed


progress = Progress()
_originals: dict[str, Callable[..., Any]] = {}
_ddp_forward: Callable[..., Any] | None = None


def install() -> bool:
    """Wrap the collectives of an already-imported torch; False when torch is absent."""
    if "torch" not in sys.modules or _originals:
        return bool(_originals)
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return False
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            _originals[name] = fn
            setattr(dist, name, _counted(fn, name))
    _hook_ddp(DistributedDataParallel)
    return True


def uninstall() -> None:
    global _ddp_forward
    if not _originals:
        return
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()
    if _ddp_forward is not None:
        DistributedDataParallel.forward = _ddp_forward  # type: ignore[method-assign]
        _ddp_forward = None


def installed() -> bool:
    return bool(_originals)


def _counted(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    compiling = compiling_check()

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # in a dynamo trace (SyncBatchNorm's): the counter's lock would break
            return fn(*args, **kwargs)  # the graph, which fullgraph=True forbids
        progress.enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            progress.leave()  # an async_op returns at once: it counts as completed here

    counted.__breakpod_original__ = fn  # type: ignore[attr-defined]
    return counted


def _hook_ddp(ddp: Any) -> None:
    """DDP reduces in C++, past the wrappers: count its buckets with a comm hook."""
    global _ddp_forward
    original = ddp.forward
    _ddp_forward = original

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_breakpod_counted", False):
            _register_counting_hook(self)
        return original(self, *args, **kwargs)

    ddp.forward = forward


def _register_counting_hook(model: Any) -> None:
    model._breakpod_counted = True
    if getattr(model, "_comm_hooks", None):  # the user's own hook: leave it alone
        return
    try:
        import torch
        import torch.distributed as dist

        later: list[tuple[Callable[..., Any], Any]] = []  # the job's hook, registered after
        counting = _counting_hook(later)
        # DDP checks the hook's annotations as objects, not the strings this module has.
        counting.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,  # type: ignore[attr-defined]
            "return": torch.futures.Future[torch.Tensor],
        }
        register = model.register_comm_hook
        # its state is DDP's own group: None would average every bucket over the world
        register(model.process_group, counting)
        model.register_comm_hook = _chaining(model, register, later)
    except Exception:  # an older DDP or a hook registered another way: count nothing
        return


def _chaining(model: Any, register: Callable[..., Any], later: list[Any]) -> Callable[..., Any]:
    """DDP takes one comm hook, and the counting one came first: a hook the job registers
    afterwards runs inside it, where DDP would have refused it ("can only be called once")."""

    def register_comm_hook(state: Any, hook: Callable[..., Any]) -> None:
        if later:  # the job's second hook: DDP's own refusal
            register(state, hook)
            return
        model._check_comm_hook(hook)  # DDP's checks of the hook, in its words
        model._comm_hooks.append((hook, state))
        later.append((hook, state))

    return register_comm_hook


def _counting_hook(later: list[Any]) -> Callable[..., Any]:
    def counting_allreduce(state: Any, bucket: Any) -> Any:
        """The job's own hook if it registered one later, else DDP's default (average the
        bucket over DDP's group): counted once per bucket."""
        progress.enter("DDP all_reduce")
        try:
            if later:
                hook, own_state = later[0]
                future = hook(own_state, bucket)
            else:
                future = _average(state, bucket)
        except BaseException:
            progress.leave()
            raise

        def completed(done: Any) -> Any:
            progress.leave()
            value = done.value()
            return value[0] if isinstance(value, list) else value  # all_reduce's is a list

        return future.then(completed)

    return counting_allreduce


def _average(group: Any, bucket: Any) -> Any:
    import torch.distributed as dist

    tensor = bucket.buffer().div_(dist.get_world_size(group))
    all_reduce = _originals.get("all_reduce", dist.all_reduce)  # not counted twice
    return all_reduce(tensor, group=group, async_op=True).get_future()  # type: ignore[no-untyped-call]
