"""The ranks whose updates must match this one's: a data-parallel model's (DDP's replicas,
FSDP's shards and their replicas).

What a rank judges alone (its own batch's loss, the detailed tier's activations, a
debugger's ``skip`` at its park) may differ from the others' verdicts. A skip of one
rank alone parts the replicas (DDP: their weights differ from then on) or updates a
sharded model in part (FSDP). So a monitor that can skip an update (a ``skip`` or
``break`` rule) agrees with its peers at each update: one all-reduce of two counts (the
ranks that skip, those that leave), a skip of any wins, and a rank that skips for another
says so. A monitor closed on one rank makes one more, to leave (:class:`Departure`).

A collective must be made by every rank of its group, or the job hangs. So the peers
first answer a roll call in the job's store (``roll_call.py``: no collective); a
model watched on some ranks only is judged by each rank alone, as it says.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from breakpod._core.announce import announce
from breakpod._monitor.roll_call import Collectives
from breakpod._monitor.sharding import mesh_of, mesh_ranks, sharded


class Peers:
    """Skips agreed with the ranks of ``groups``: if one skips an update, all do."""

    def __init__(self, groups: Sequence[Any], ranks: list[int]) -> None:
        self._over = Collectives(groups, ranks, "train the model", "each rank skips for itself")
        self._size = len(ranks)
        # the verdict's two elements, reused (no tensor made a step): the ranks that skip
        # this update, and those whose monitor closed and leave the agreement with it
        self._flag: Any = None
        self.leaving = False  # this rank's monitor closed: its next agreement is its last

    @property
    def owed(self) -> bool:
        """Will the peers make their next agreement with this rank? (So a monitor closed
        here must make it too, or they wait in it: a hang, or another collective's data.)"""
        return self._over.live

    def agree(self, skip: bool, step: int) -> bool:
        """This update's verdict: does any peer skip it? (A collective, and one read.) A
        peer that left (its monitor closed) ends the agreement, for every rank at once."""
        groups = self._over.groups()
        if not groups:
            return skip
        import torch
        import torch.distributed as dist

        if self._flag is None:
            self._flag = torch.zeros(2, device=self._over.device)
        self._flag[0].fill_(float(skip))
        self._flag[1].fill_(float(self.leaving))
        for group in groups:  # summed over each group in turn: over all the ranks
            dist.all_reduce(self._flag, op=dist.ReduceOp.SUM, group=group)
        skips, left = self._flag.tolist()
        if left:
            self._over.disband()
            if not self.leaving:
                announce(
                    f"step {step}: {left:.0f} of the {self._size} ranks closed their monitor: "
                    "from the next update on, each rank skips for itself (a skip of one rank "
                    "alone parts the replicas: close the monitor on every rank at once)"
                )
        return bool(skips > 0)


class Departure:
    """A closed monitor's last agreement with its peers, made where they make their next
    (the next update): it says that this rank leaves, and follows their skip of that
    update (this rank's update alone applied would part the replicas). It holds the
    optimizer and the model weakly: one owed at the end of training frees them."""

    def __init__(self, peers: Peers, step: int, optimizer: Any, model: Any) -> None:
        peers.leaving = True
        self._peers: Peers | None = peers
        self._step = step
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._model = weakref.ref(model)

    def __call__(self) -> None:
        peers, self._peers = self._peers, None
        if peers is None:
            return
        try:
            if peers.agree(False, self._step):
                follow(self._step)
                drop_update(self._optimizer and self._optimizer(), self._model())
        except Exception as e:  # the agent's failure, never the job's
            announce(f"monitor's last agreement failed ({type(e).__name__}: {e}); job continues")
            return
        announce(f"step {self._step}: this rank's monitor closed: it left its peers' agreements")


class Departures:
    """The departures owed where a step ends: at an optimizer's step, as its step
    pre-hook, or in ``monitor.step()`` for the model. The hook is registered before the
    first monitor's own, and kept (a hook cannot be removed while the optimizer runs its
    hooks; an idle one costs a call a step): so every rank makes its departures before
    its new monitor's agreement, and a monitor closed each epoch adds no hook."""

    def __init__(self) -> None:
        self.owed: list[Departure] = []

    def __call__(self, *_: Any) -> None:
        owed, self.owed = self.owed, []
        for departure in owed:  # in the order the monitors closed: as on every rank
            departure()


# an optimizer (its step pre-hook) or a model without one (monitor.step()) -> its departures
_DEPARTURES: weakref.WeakKeyDictionary[Any, Departures] = weakref.WeakKeyDictionary()


def departures_at(where: Any) -> Departures:
    """The departures made at ``where``'s step: an optimizer's, or a model's."""
    departures = _DEPARTURES.get(where)
    if departures is None:
        departures = _DEPARTURES[where] = Departures()
        if hasattr(where, "register_step_pre_hook"):
            where.register_step_pre_hook(departures)
    return departures


def departures_in_job(where: Any, probe: bool) -> Departures | None:
    """The departures at ``where`` (see :func:`departures_at`) in a job of several ranks."""
    return departures_at(where) if not probe and several_ranks() else None


def several_ranks() -> bool:
    """Is this process one rank of a job of several (torch.distributed initialized)?"""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    return bool(dist.get_world_size() > 1)


def follow(step: int) -> None:
    announce(
        f"step {step}: another rank skips this update, so this rank does too (one rank alone "
        "would part the replicas, or update a sharded model in part)"
    )


def drop_update(optimizer: Any, model: Any) -> None:
    """Leave this update undone: optimizers leave a parameter without a gradient as it is."""
    groups = optimizer.param_groups if optimizer is not None else ()
    params = [p for group in groups for p in group["params"]] or list(model.parameters())
    for p in params:
        p.grad = None


def peers_of(model: Any, params: Sequence[Any]) -> Peers | None:
    """The peers of a data-parallel ``model`` in a job of several ranks, else None."""
    if not several_ranks():
        return None
    if isinstance(model, sys.modules["torch.nn.parallel"].DistributedDataParallel):
        return replicas_of(model)
    mesh = mesh_of(params)
    if mesh is not None:  # FSDP2: every dimension of its mesh, replicas and shards
        return Peers([mesh.get_group(d) for d in range(mesh.ndim)], mesh_ranks(mesh))
    if sharded(params):  # FSDP1: its units' process groups make up the world
        dist = sys.modules["torch.distributed"]
        return Peers([dist.group.WORLD], list(range(dist.get_world_size())))
    return None


def running_ddp() -> Any:
    """The ``DistributedDataParallel`` whose forward runs now, if any (DDP marks it for
    TorchDynamo), else None."""
    ddp = sys.modules["torch.nn.parallel"].DistributedDataParallel
    return getattr(ddp, "_active_ddp_module", None)


# what a rank says of a NaN/Inf its own step did not make (sentinel.py, detect.py)
VIA_ALL_REDUCE = (
    "the NaN/Inf most likely reached its gradients through DDP's all-reduce, from another "
    "rank (whose own report says where)"
)


def in_synced_ddp_forward() -> bool:
    """Does this forward run inside DDP's, with its gradients to be averaged? (DDP's
    Python reducer marks nothing: the watched model being DDP tells that one apart.)"""
    active = running_ddp()
    return active is not None and bool(getattr(active, "require_backward_grad_sync", True))


def ddp_in(modules: Iterable[Any]) -> Any:
    """The ``DistributedDataParallel`` among ``modules``, if any."""
    ddp = sys.modules["torch.nn.parallel"].DistributedDataParallel
    return next((m for m in modules if isinstance(m, ddp)), None)


def replicas_of(ddp: Any, model: Any = None) -> Peers | None:
    """The peers of DDP's replicas (of ``model``, if DDP wraps it), else None."""
    if model is not None and not any(m is model for m in ddp.module.modules()):
        return None
    import torch.distributed as dist

    group = ddp.process_group
    ranks = dist.get_process_group_ranks(group)
    return Peers([group], ranks) if len(ranks) > 1 else None
