"""A small CPU training job whose loss goes NaN, watched by breakpod.

Run headless (stdin is /dev/null, as in a container) with
PYTHONBREAKPOINT=breakpod.set_trace: the monitors name the first module that
produced the NaN, and instead of dying with BdbQuit the job parks on a
socket and waits for `breakpod attach`. With BREAKPOD_BROKER_URL set, the
broker lists the parked job and records its events.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
from torch import nn

import breakpod

POISON_STEP = int(os.environ.get("DEMO_POISON_STEP", "7"))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16)
    if step == POISON_STEP:
        x[3, 5] = float("nan")  # one corrupt sample, as from a bad shard
    return x, x.sum(dim=1, keepdim=True)


def build() -> nn.Module:
    layers = [("encoder", nn.Linear(16, 32)), ("act", nn.ReLU()), ("head", nn.Linear(32, 1))]
    return nn.Sequential(OrderedDict(layers))


def main() -> None:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model)  # on-device checks, read at each step boundary
    for step in range(10):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        finite = bool(torch.isfinite(loss))
        if finite:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        monitor.step(loss)
        if not finite:
            print(f"step {step}: loss is {loss.item()}; breaking into the debugger", flush=True)
            breakpoint()
            continue  # the poisoned update was skipped
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    monitor.close()
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
