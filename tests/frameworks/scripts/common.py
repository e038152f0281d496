"""What every framework script shares: a small model, a poisoned module, the rule."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

NAN_AT = int(os.environ.get("NAN_AT", "-1"))  # the training forward whose module turns NaN
NAN_RANK = int(os.environ.get("NAN_RANK", "-1"))  # ... on this rank alone (-1: on every rank)
REPLAYABLE = os.environ.get("REPLAYABLE") == "1"  # ... and on that same input again
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))  # this rank hangs in its step ...
HANG_AT = int(os.environ.get("HANG_AT", "3"))  # ... at this step
BREAK_RANK = int(os.environ.get("BREAK_RANK", "-1"))  # breakpoint() on this rank ...
BREAK_AT = int(os.environ.get("BREAK_AT", "2"))  # ... at this step
STEPS = int(os.environ.get("STEPS", "8"))
EXPLICIT = os.environ.get("MODE") == "explicit"
PARK_RULES = [{"name": "nan-park", "check": "nonfinite", "action": ["log", "break"]}]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.encoder(x))))


def poison(module: nn.Module) -> None:
    """The NAN_AT-th training forward of ``module`` returns NaN (user code, no breakpod)."""
    calls = [0]
    bad: list[torch.Tensor] = []  # REPLAYABLE: the input it turned NaN on, which again does
    if NAN_RANK not in (-1, rank()):
        return

    def hook(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        calls[0] += 1
        if REPLAYABLE and bad and torch.equal(inputs[0], bad[0]):
            return output * float("nan")  # a fault of the data: the step's replay makes it too
        if calls[0] - 1 != NAN_AT:
            return None
        bad.append(inputs[0].detach().clone())
        return output * float("nan")

    module.register_forward_hook(hook)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def user_step(step: int) -> None:
    """What a rank does in its step besides the model: hang or break when told."""
    if rank() == HANG_RANK and step == HANG_AT:
        print(f"rank {rank()} hangs at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.2)  # hangs_here
    if rank() == BREAK_RANK and step == BREAK_AT:
        breakpoint()


def finish(model: nn.Module) -> None:
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"finished rank {rank()} finite={finite}", flush=True)


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
