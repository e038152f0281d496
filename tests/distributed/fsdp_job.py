"""A sharded job (gloo, CPU): an embedding and a head under FSDP2 (``fully_shard``) or
FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``), watched by breakpod.

At step BAD_AT, one token's gradient is poisoned on its way back into the embedding
(NaN, or times POISON): only the embedding's rows of that token go bad, and they lie in
one rank's shard (row 7 of 10 is rank 1's, in both layouts, on two ranks). Each rank
then writes what it found and the embedding's full weight before and after the step.

Env:
- FSDP: 1, 1-unsharded (NO_SHARD), 2, hsdp (four ranks), or ddp (DDP's replicas);
- POISON: nan, or the factor of a spike; BAD_AT: its step;
- MAX_NORM: a grad_norm skip rule's limit; PARK: the NaN parks; CHECK_EVERY;
- WATCH_FIRST: watch() before wrapping; WATCH_RANK: the only rank that watches;
  WATCH_INNER: watch the module DDP wraps (as debug mode's zero-code watch does);
- MICRO: backwards a step (FSDP2's, or DDP's under no_sync() but the last);
  NAN_LOSS_RANK: that rank's loss alone NaN (its
  gradients finite); SPIKE_LOSS_RANK: that rank's loss alone x1000, LOSS_SKIP: a
  loss_spike rule skips; STEPS; COMPILE: the wrapped model compiled (aot_eager);
- CLOSE_RANK (a rank, or "all") closes its monitor after step CLOSE_AT, and trains on;
- REWATCH_EVERY: every rank closes its monitor and watches anew every that many steps (a
  monitor an epoch; a loss_spike rule then needs 3 steps of history, not 10); LATE_RANK:
  that rank closes 1 s after the others; CLOSE_WAIT: the seconds a sharded model's
  monitor waits at close() for the other ranks' (breakpod's is 5);
- FAIL_RANK: that rank's monitor fails from step FAIL_AT on (a fault injected into the
  agent), at each step's end and each backward's norms."""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

import breakpod

FSDP, BAD_AT = os.environ["FSDP"], int(os.environ["BAD_AT"])
STEPS = int(os.environ.get("STEPS", "6"))
POISON = float(os.environ["POISON"])
MICRO = int(os.environ.get("MICRO", "1"))  # backwards a step
NAN_LOSS_RANK = int(os.environ.get("NAN_LOSS_RANK", "-1"))  # its loss alone NaN at BAD_AT
SPIKE_LOSS_RANK = int(os.environ.get("SPIKE_LOSS_RANK", "-1"))  # its loss alone x1000
REWATCH_EVERY = int(os.environ.get("REWATCH_EVERY", "0"))
CLOSE_RANK, CLOSE_AT = os.environ.get("CLOSE_RANK", ""), int(os.environ.get("CLOSE_AT", "-1"))
TOKEN = 7
STEP = [0]  # the step the loop is in


class Poisoned(torch.autograd.Function):
    """Identity forward; backward spoils the gradient at ``TOKEN``'s positions."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, grad * POISON, grad), None


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 3)
        self.poison = False

    def forward(self, tokens):
        e = self.emb(tokens)
        if self.poison:
            e = Poisoned.apply(e, (tokens == TOKEN).unsqueeze(-1))
        return self.head(e)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    early = breakpod.watch(net) if os.environ.get("WATCH_FIRST") else None  # before FSDP
    model = shard(net)
    if os.environ.get("COMPILE"):  # the sharded model compiled (after watch() or before)
        model = torch.compile(model, backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    rules = None
    if "MAX_NORM" in os.environ:
        skip = {"name": "spikes", "check": "grad_norm", "action": ["log", "skip"]}
        rules = [{**skip, "max_norm": float(os.environ["MAX_NORM"])}]
    if os.environ.get("LOSS_SKIP"):  # a loss spike drops the update
        rules = [{"name": "lspike", "check": "loss_spike", "action": ["log", "skip"]}]
        if REWATCH_EVERY:
            rules[0]["min_history"] = 3
    if os.environ.get("PARK"):  # the NaN parks each rank, for a debugger
        rules = [{"name": "nan", "check": "nonfinite", "action": ["log", "break"]}]
    monitor = early
    if early is None and rank == int(os.environ.get("WATCH_RANK", rank)):  # else: not this one
        every = int(os.environ.get("CHECK_EVERY", "1"))
        watched = net if os.environ.get("WATCH_INNER") else model
        monitor = breakpod.watch(watched, rules, optimizer=opt, check_every=every)
    anomalies = []
    torch.manual_seed(1 + rank)
    if "CLOSE_WAIT" in os.environ:
        breakpod._monitor.monitor.CLOSE_WAIT = float(os.environ["CLOSE_WAIT"])
    if rank == int(os.environ.get("FAIL_RANK", "-1")):
        inject_faults(int(os.environ["FAIL_AT"]))
    for step in range(STEPS):
        STEP[0] = step
        tokens = torch.randint(0, 10, (8, 5))
        tokens[0, 0] = TOKEN  # in every rank's batch: its row gets a gradient
        net.poison = step == BAD_AT
        opt.zero_grad()
        for micro in range(MICRO):  # accumulating: no reduction but the last backward's
            last = micro == MICRO - 1
            if MICRO > 1 and FSDP != "ddp":
                net.set_requires_gradient_sync(last)
            with model.no_sync() if FSDP == "ddp" and not last else contextlib.nullcontext():
                loss = model(tokens).pow(2).mean()
                loss = loss_of(rank, step, loss)
                loss.backward()
        if step == BAD_AT:
            say(rank, f"the embedding's gradient norm {full(net.emb.weight.grad).norm():.6e}")
        before = full(net.emb.weight)
        if early is not None:
            early.step(loss)  # no optimizer= (made after wrapping): the step ends here
        elif monitor is not None:
            monitor.record_loss(loss)  # judged with its step, before the update
        opt.step()
        if step == CLOSE_AT and monitor is not None and CLOSE_RANK in ("all", str(rank)):
            monitor.close()
            say(rank, f"closed its monitor after step {step}")
        if REWATCH_EVERY and (step + 1) % REWATCH_EVERY == 0:  # an epoch's end
            if rank == int(os.environ.get("LATE_RANK", "-1")):
                time.sleep(1.0)
            monitor.close()
            anomalies += monitor.anomalies
            monitor = breakpod.watch(watched, rules, optimizer=opt, check_every=every)
        if step == BAD_AT:
            changed = (full(net.emb.weight) != before).any(dim=1).nonzero().flatten().tolist()
            say(rank, f"rows updated at the bad step {changed}")
    if monitor is not None:
        monitor.close()
        anomalies += monitor.anomalies
        say(rank, f"optimizer step pre-hooks left {len(opt._optimizer_step_pre_hooks)}")
    for a in anomalies:
        say(rank, f"found {a} | skipped={a.skipped} | value={a.value:.6e}")
    dist.barrier()
    # out without tearing gloo down: its teardown aborts now and then ("terminate called
    # without an active exception", after every rank is done; breakpod or not)
    os._exit(0)


def loss_of(rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
    if rank == NAN_LOSS_RANK and step == BAD_AT:  # NaN, its gradients finite
        loss = loss + torch.tensor(float("nan"))
    if rank == SPIKE_LOSS_RANK and step == BAD_AT:  # an outlier batch on one rank
        loss = loss * 1000
    return loss


def inject_faults(start: int) -> None:
    """The monitor's own failures from step ``start`` on: in the step's end, before its read
    and its agreed skip; in each backward, before the norms' sum with the other ranks."""
    from breakpod._monitor import norms, staging

    def failing(real):
        def run(*args, **kwargs):
            if STEP[0] >= start:
                raise RuntimeError("a fault injected into the monitor")
            return real(*args, **kwargs)

        return run

    staging.Stager.end_step = failing(staging.Stager.end_step)
    norms.NormPlan.__call__ = failing(norms.NormPlan.__call__)


def shard(net: Net) -> torch.nn.Module:
    if FSDP == "ddp":  # replicas, not shards
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net)
    if FSDP in ("2", "hsdp"):  # hsdp: four ranks, two replicas of two shards
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = (
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicas", "shards"))
            if FSDP == "hsdp"
            else None
        )
        fully_shard(net, mesh=mesh)
        return net
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    strategy = ShardingStrategy.NO_SHARD if FSDP == "1-unsharded" else ShardingStrategy.FULL_SHARD
    cpu = torch.device("cpu")
    return FullyShardedDataParallel(
        net, device_id=cpu, use_orig_params=True, sharding_strategy=strategy
    )


def full(t: torch.Tensor) -> torch.Tensor:
    """The embedding's whole weight (or gradient), on every rank: FSDP2's DTensor
    gathered, or FSDP1's flat pieces (each rank a run of its elements) put together."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    if FSDP in ("1-unsharded", "ddp"):  # whole on every rank
        return t.detach().clone().reshape(10, 4)
    pieces = [torch.zeros(0)] * dist.get_world_size()
    dist.all_gather_object(pieces, t.detach().flatten().clone())
    return torch.cat(pieces).reshape(10, 4)


def say(rank: int, line: str) -> None:
    os.write(2, f"rank {rank}: {line}\n".encode())  # one write: ranks' lines do not mix


if __name__ == "__main__":
    main()
