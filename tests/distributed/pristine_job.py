"""A DDP job that never imports breakpod, run under torchrun (gloo, CPU), for
``breakpod stacks --pid``. Each rank prints ``rank N at step S`` on stderr.

STALL_RANK=1 STALL_KIND=block|spin STALL_AT=3   the rank that stops stepping there
LEVEL_AT=3   every rank waits in a receive nobody sends at that step (a level job)
WORKERS=1    batches come from a DataLoader with that many worker processes
"""

import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

RANK = int(os.environ["RANK"])
STALL_RANK = int(os.environ.get("STALL_RANK", "-1"))
STALL_AT = int(os.environ.get("STALL_AT", "3"))
STALL_KIND = os.environ.get("STALL_KIND", "block")
LEVEL_AT = int(os.environ.get("LEVEL_AT", "-1"))
WORKERS = int(os.environ.get("WORKERS", "0"))  # DataLoader workers: children with RANK too


def batches():
    if not WORKERS:
        while True:
            yield torch.randn(8, 4)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 4))
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, num_workers=WORKERS, persistent_workers=True
    )
    while True:
        for (x,) in loader:
            yield x


def load_shard(step, source):
    """The user's helper a rank hangs in (a dataloader deadlock, a slow filesystem)."""
    if RANK == STALL_RANK and step == STALL_AT:
        print(f"rank {RANK} stalls now", file=sys.stderr, flush=True)
        if STALL_KIND == "spin":
            spin()
        threading.Event().wait()
    return next(source)


def spin():
    n = 0
    while True:  # pure Python, holding the GIL
        n += 1


def wait_for_peers():
    """Every rank in one point-to-point wait that never ends: nobody is behind."""
    print(f"rank {RANK} waits level", file=sys.stderr, flush=True)
    dist.recv(torch.zeros(1), src=(RANK + 1) % dist.get_world_size())


def main():
    if any(name.partition(".")[0] == "breakpod" for name in sys.modules):
        sys.exit("pristine_job: breakpod was imported (the job must have no breakpod in it)")
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    source = batches()
    for step in range(10_000):
        print(f"rank {RANK} at step {step}", file=sys.stderr, flush=True)
        if step == LEVEL_AT:
            wait_for_peers()
        batch = load_shard(step, source)
        loss = model(batch).sum()
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(loss.detach())
        opt.step()


if __name__ == "__main__":
    main()
