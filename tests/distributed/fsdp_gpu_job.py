"""FSDP2 on one GPU (NCCL, a world of one): the shards' norms are all-reduced every step,
and a spike's update is dropped by the fused Adam on the device, with no host sync in
any step between the monitor's reads (``torch.cuda.set_sync_debug_mode("error")``).
Exits 0 when every step but the spike's was applied and the monitor failed nowhere."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import breakpod

EVERY, SPIKE_AT, STEPS = 5, 12, 20
SPIKES = {"name": "spikes", "check": "grad_norm", "max_norm": 50.0, "action": ["log", "skip"]}


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.cuda()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    monitor = breakpod.watch(model, [SPIKES], optimizer=opt, check_every=EVERY, replay=False)
    applied = []
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    torch.cuda.synchronize()
    for step in range(STEPS):
        before = [p.detach().to_local().clone() for p in model.parameters()]
        torch.cuda.set_sync_debug_mode("error" if step % EVERY != EVERY - 1 else 0)
        try:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss = loss * (1e4 if step == SPIKE_AT else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        after = [p.detach().to_local() for p in model.parameters()]
        applied.append(not all(torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    monitor.flush()
    print(f"applied {applied}; errors {monitor.errors}; anomalies {monitor.anomalies}")
    ok = monitor.errors == 0 and applied == [i != SPIKE_AT for i in range(STEPS)]
    monitor.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
