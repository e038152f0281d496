"""The ranks whose updates must match this one's: a data-parallel model's (DDP's replicas,
FSDP's shards and their replicas).

What a rank judges alone (its own batch's loss, the detailed tier's activations, a
debugger's ``skip`` at its park) may differ from the others' verdicts. A skip of one
rank alone parts the replicas (DDP: their weights differ from then on) or updates a
sharded model in part (FSDP). So a monitor that can skip an update (a ``skip`` or
``break`` rule) agrees with its peers at each update: one all-reduce of a flag, the
largest verdict wins, and a rank that skips for another says so.

A collective must be made by every rank of its group, or the job hangs. So the peers
first answer a roll call in the job's store (``roll_call.py``: no collective); a
model watched on some ranks only is judged by each rank alone, as it says.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from breakpod._monitor.roll_call import Collectives
from breakpod._monitor.sharding import mesh_of, mesh_ranks, sharded


class Peers:
    """Skips agreed with the ranks of ``groups``: if one skips an update, all do."""

    def __init__(self, groups: Sequence[Any], ranks: list[int]) -> None:
        self._over = Collectives(groups, ranks, "train the model", "each rank skips for itself")
        self._flag: Any = None  # the verdict's one element, reused: no tensor made a step

    def agree(self, skip: bool) -> bool:
        """This update's verdict, the peers' largest (a collective, and one read)."""
        groups = self._over.groups()
        if not groups:
            return skip
        import torch
        import torch.distributed as dist

        if self._flag is None:
            self._flag = torch.zeros(1, device=self._over.device)
        self._flag.fill_(1.0 if skip else 0.0)
        for group in groups:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=group)
        return bool(self._flag.item())


def peers_of(model: Any, params: Sequence[Any]) -> Peers | None:
    """The peers of a data-parallel ``model`` in a job of several ranks, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2:
        return None
    if isinstance(model, sys.modules["torch.nn.parallel"].DistributedDataParallel):
        return replicas_of(model)
    mesh = mesh_of(params)
    if mesh is not None:  # FSDP2: every dimension of its mesh, replicas and shards
        return Peers([mesh.get_group(d) for d in range(mesh.ndim)], mesh_ranks(mesh))
    if sharded(params):  # FSDP1: its units' process groups make up the world
        return Peers([dist.group.WORLD], list(range(dist.get_world_size())))
    return None


def running_ddp() -> Any:
    """The ``DistributedDataParallel`` whose forward runs now, if any (DDP marks it for
    TorchDynamo), else None."""
    ddp = sys.modules["torch.nn.parallel"].DistributedDataParallel
    return getattr(ddp, "_active_ddp_module", None)


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
