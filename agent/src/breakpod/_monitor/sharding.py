"""Gradients sharded across ranks: FSDP2's (``fully_shard``: DTensor parameters) and
FSDP1's (``FullyShardedDataParallel``: each rank a slice of the flat parameters).

Each rank holds a shard of every gradient, so the norms it can take alone are its
shard's. Judged on those, ranks disagree: a NaN or a spike in rank 1's rows skips
rank 1's update while rank 0 applies its own, and the model ends half updated (torch's
``ShardedGradScaler`` all-reduces its ``found_inf`` for the same reason). So the squared
norms of the shards are summed over the ranks that shard them, one all-reduce a step of
one small vector, a float64 per parameter. Every rank then holds the full parameters'
norms, those an unsharded job would have: it judges the same, says the same and skips
the same updates. On a GPU the all-reduce is queued on the stream: no host sync.

The all-reduce must come at the same point on every rank, every step, or the job hangs:
it is made wherever the gradient norms are, with a vector of the same length on every
rank whatever its shard holds (a rank with no part of a parameter adds 0). Whatever is
read only on one rank (a tensor's NaN count, a pdb command's summary) is read from the
rank's own shard (:func:`local`), never through a DTensor op that would call the others.

Parameters of another layout (several device meshes, a ``Partial`` placement, FSDP1
units on different process groups, or outside the module watched) are said once and
judged per rank, as before. A sharded model's forward is never run by one rank alone
(:func:`sharded`): the replay stands aside.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from breakpod._core.announce import announce
from breakpod._monitor.roll_call import Collectives

Norms = list[tuple[Any, list[int], Any]]  # (device, keys, norms), as NormPlan gives them
FSDP1_SHARDED = frozenset({"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"})
FSDP1_FLATTENED = "_fsdp_flattened"  # the mark FSDP1 leaves on each parameter it manages
MADE = 64  # index tensors kept on the device
_SAID: set[str] = set()  # the layouts said unsupported (once a process: probes plan too)


def local(tensor: Any) -> Any:
    """A DTensor's shard on this rank (no communication), else ``tensor`` itself."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is None or not _is_dtensor(tensor):
        return tensor
    import torch

    with torch.no_grad():  # the shard itself, not a differentiable view of it
        return to_local()


def shard_of(tensor: Any) -> str:
    """`` (this rank's shard of [10,4])`` for a DTensor of which this rank holds part, else
    ``""`` (a plain tensor, or a replica: whole on every rank)."""
    piece = local(tensor)
    if piece is tensor or tuple(piece.shape) == tuple(tensor.shape):
        return ""
    return f" (this rank's shard of [{','.join(map(str, tensor.shape))}])"


class ShardedNorms:
    """Full norms from each rank's shards: squares summed over ``groups`` (of ``ranks``)."""

    def __init__(
        self, groups: Sequence[Any], weights: Sequence[float], empty: set[int], ranks: list[int]
    ) -> None:
        self._weights = list(weights)  # 1 / the replicas summed over too, per parameter
        self._weighted = any(w != 1.0 for w in weights)
        self._empty = empty  # parameters of which this rank holds nothing
        self._made: dict[Any, Any] = {}  # (device, index or "weights") -> its tensor
        self.sums = 0  # made with the other ranks (a rank's part is owed at each backward)
        # a rank alone summing would meet the others' next FSDP collective (a hang)
        self.collectives = Collectives(
            groups, ranks, "shard the model", "each rank judges its own shard's gradient norms"
        )

    def full(self, parts: Norms) -> Norms:
        """The full parameters' norms, on every rank alike, from this rank's ``parts``."""
        import torch
        import torch.distributed as dist

        groups = self.collectives.groups()
        if not groups:  # not every rank watches: each judges its own shards
            return parts
        self.sums += 1
        device = parts[0][0] if parts else self.collectives.device
        squares = torch.zeros(len(self._weights), dtype=torch.float64, device=device)
        for _, keys, norms in parts:
            index = self._on(device, tuple(keys))
            squares.index_copy_(0, index, norms.to(device, torch.float64).square())
        if self._weighted:
            squares *= self._on(device, "weights")
        for group in groups:
            dist.all_reduce(squares, group=group)
        if not parts:  # no gradient on any rank (a backward under FSDP2's no-sync)
            return []
        keys = sorted({k for _, ks, _ in parts for k in ks} | self._empty)
        norms = squares.sqrt().float().index_select(0, self._on(device, tuple(keys)))
        return [(device, keys, norms)]

    def _on(self, device: Any, what: Any) -> Any:
        """An index (or the weights) on ``device``, made once: no copy a step."""
        made = self._made.get((device, what))
        if made is None:
            import torch

            if len(self._made) > MADE:  # the gradients present change every step
                self._made.clear()
            values, dtype = (
                (self._weights, torch.float64) if what == "weights" else (what, torch.long)
            )
            made = self._made[(device, what)] = torch.tensor(values, dtype=dtype, device=device)
        return made


def sharded(params: Sequence[Any]) -> bool:
    """Are ``params`` sharded by FSDP? Their module's forward then gathers them from the
    other ranks (FSDP1's backward also reduces, even unsharded): nothing may run it alone."""
    return any(_is_dtensor(p) or getattr(p, FSDP1_FLATTENED, False) for p in params)


def sharding_of(model: Any, params: Sequence[Any]) -> ShardedNorms | None:
    """How ``model``'s ``params`` are sharded across ranks, for their norms, or None: a job
    that shards nothing, or one of a layout the norms cannot be summed for (said)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or not params:
        return None
    if any(_is_dtensor(p) for p in params):
        return _fsdp2(params)
    if any(getattr(p, FSDP1_FLATTENED, False) for p in params):
        return _fsdp1(model, params)
    return None


def mesh_of(params: Sequence[Any]) -> Any:
    """The one device mesh of ``params``' DTensors (FSDP2), else None."""
    meshes = {p.device_mesh for p in params if _is_dtensor(p)}
    return meshes.pop() if len(meshes) == 1 else None


def mesh_ranks(mesh: Any) -> list[int]:
    """Every rank of ``mesh``, the same list on each."""
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _fsdp2(params: Sequence[Any]) -> ShardedNorms | None:
    from torch.distributed.tensor import Replicate, Shard

    mesh = mesh_of(params)
    if mesh is None:
        return _unsupported("its parameters lie on several device meshes")
    placements = [p.placements if _is_dtensor(p) else None for p in params]
    if any(not isinstance(pl, Shard | Replicate) for pls in placements if pls for pl in pls):
        return _unsupported("a parameter has a placement neither Shard nor Replicate")
    dims = sorted(
        {d for pls in placements if pls for d, pl in enumerate(pls) if isinstance(pl, Shard)}
    )
    if not dims:  # replicated everywhere: each rank's norms are the full ones already
        return None
    weights = []
    for pls in placements:  # a plain tensor is whole on every rank: replicated everywhere
        replicas = [mesh.size(d) for d in dims if pls is None or isinstance(pls[d], Replicate)]
        weights.append(1.0 / math.prod(replicas))
    empty = {i for i, p in enumerate(params) if local(p).numel() == 0}
    return ShardedNorms([mesh.get_group(d) for d in dims], weights, empty, mesh_ranks(mesh))


def _fsdp1(model: Any, params: Sequence[Any]) -> ShardedNorms | None:
    cls = sys.modules["torch.distributed.fsdp"].FullyShardedDataParallel
    units = [m for m in model.modules() if isinstance(m, cls)]
    if not units:
        return _unsupported(
            "the FSDP unit around the watched module is outside it (watch the module that "
            "FullyShardedDataParallel returned)"
        )
    sharding = {u.sharding_strategy.name in FSDP1_SHARDED for u in units}
    if sharding == {False}:  # NO_SHARD: every rank's gradients are whole, all-reduced
        return None
    if len(sharding) > 1:
        return _unsupported("some of its FSDP units shard and some do not (NO_SHARD)")
    groups = {id(u.process_group): u.process_group for u in units}
    if len(groups) > 1:
        return _unsupported("its FSDP units shard over different process groups")
    group = groups.popitem()[1]
    size = sys.modules["torch.distributed"].get_world_size(group)
    # a parameter outside every unit is whole on every rank
    weights = [1.0 if getattr(p, FSDP1_FLATTENED, False) else 1.0 / size for p in params]
    empty = {i for i, p in enumerate(params) if p.numel() == 0}
    ranks = sys.modules["torch.distributed"].get_process_group_ranks(group)
    return ShardedNorms([group], weights, empty, ranks)


def _unsupported(why: str) -> ShardedNorms | None:
    """None, the job's norms judged per rank, which is said once a process."""
    if why in _SAID:
        return None
    _SAID.add(why)
    announce(
        f"monitor: the model is sharded across ranks, but {why}: each rank judges its own "
        "shard's gradient norms, and ranks may disagree on a step"
    )
    return None


def _is_dtensor(tensor: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
