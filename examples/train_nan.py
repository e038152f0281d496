"""A small CPU training job whose loss goes NaN, with a breakpoint() there.

Run headless (stdin is /dev/null, as in a container) with
PYTHONBREAKPOINT=breakpod.set_trace: instead of dying with BdbQuit, the job
parks on a socket and waits for `breakpod attach`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

POISON_STEP = int(os.environ.get("DEMO_POISON_STEP", "7"))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16)
    if step == POISON_STEP:
        x[3, 5] = float("nan")  # one corrupt sample, as from a bad shard
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            print(f"step {step}: loss is {loss.item()}; breaking into the debugger", flush=True)
            breakpoint()
            continue  # skip the poisoned update
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
