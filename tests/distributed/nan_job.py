"""A DDP job (gloo, CPU) watched by the sentinel tier; one rank's batch holds a NaN.

Env: BAD_RANK (whose batch), BAD_AT (at which step), STEPS, FORWARDS (a step's forwards
before its backward; the NaN is in the first)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import breakpod

BAD_RANK, BAD_AT = int(os.environ["BAD_RANK"]), int(os.environ["BAD_AT"])
STEPS = int(os.environ.get("STEPS", "6"))
FORWARDS = int(os.environ.get("FORWARDS", "1"))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank, as DDP requires
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, optimizer=opt)
    torch.manual_seed(1 + rank)  # each rank its own batches
    for step in range(STEPS):
        xs = [torch.randn(16, 4) for _ in range(FORWARDS)]
        if rank == BAD_RANK and step == BAD_AT:
            xs[0][0, 0] = float("nan")
        loss = sum(model(x).pow(2).mean() for x in xs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    for a in monitor.anomalies:
        said = f"{a} | how={a.how} | {a.details.get('localized')}"
        # one write a line: print() writes the text and its newline apart, and another
        # rank's line landing between them left this one mid-line (CI lost ranks 0 and 1)
        os.write(2, f"found on rank {rank}: {said}\n".encode())
    # every rank done first: a rank that tears its group down while another still talks
    # to it aborts now and then in gloo ("terminate called without an active exception",
    # 3 runs in 8 here, breakpod or not)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
