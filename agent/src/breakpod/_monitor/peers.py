"""The ranks whose updates must match this one's: a data-parallel model's (DDP's replicas,
FSDP's shards and their replicas).

What a rank judges alone (its own batch's loss, the detailed tier's activations, a
debugger's ``skip`` at its park) may differ from the others' verdicts. A skip of one
rank alone parts the replicas (DDP: their weights differ from then on) or updates a
sharded model in part (FSDP). So a monitor that can skip an update (a ``skip`` or
``break`` rule) agrees with its peers at each update: one all-reduce of a flag, the
largest verdict wins, and a rank that skips for another says so.

A collective must be made by every rank of its group, or the job hangs. So the peers
first answer a roll call in the job's store (:class:`RollCall`: no collective); a
model watched on some ranks only is judged by each rank alone, as it says.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from breakpod._monitor.roll_call import RollCall
from breakpod._monitor.sharding import mesh_of, mesh_ranks, sharded


class Peers:
    """Skips agreed with the ranks of ``groups``: if one skips an update, all do."""

    def __init__(self, groups: Sequence[Any], ranks: list[int]) -> None:
        self.groups = list(groups)
        self._roll_call: RollCall | None = RollCall(ranks, "train the model")

    def agree(self, skip: bool) -> bool:
        """This update's verdict, the peers' largest (a collective, and one read)."""
        roll_call, self._roll_call = self._roll_call, None
        if roll_call is not None and not roll_call.answered("each rank skips for itself"):
            self.groups = []
        if not self.groups:
            return skip
        import torch
        import torch.distributed as dist

        backend = dist.get_backend(self.groups[0])
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
        flag = torch.tensor([1.0 if skip else 0.0], device=device)
        for group in self.groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


def peers_of(model: Any, params: Sequence[Any]) -> Peers | None:
    """The peers of a data-parallel ``model`` in a job of several ranks, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2:
        return None
    ddp = sys.modules["torch.nn.parallel"].DistributedDataParallel
    if isinstance(model, ddp):
        group = model.process_group
        return Peers([group], dist.get_process_group_ranks(group))
    mesh = mesh_of(params)
    if mesh is not None:  # FSDP2: every dimension of its mesh, replicas and shards
        return Peers([mesh.get_group(d) for d in range(mesh.ndim)], mesh_ranks(mesh))
    if sharded(params):  # FSDP1: its units' process groups make up the world
        return Peers([dist.group.WORLD], list(range(dist.get_world_size())))
    return None
