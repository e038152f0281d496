"""Small real models and a training loop for the monitor tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Poison(nn.Module):
    """A middle layer that can turn bad: ``log(0)`` in forward, ``sqrt'(0)`` in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "forward":
            return torch.log(x * 0)  # -inf everywhere
        if self.mode == "backward":
            return x + torch.sqrt(x * 0) * 0  # same values; d/du sqrt(u) at 0 is inf -> nan grads
        return x


class Net(nn.Module):
    def __init__(
        self, d_in: int = 8, hidden: int = 16, d_out: int = 4, act: type = nn.ReLU
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act1 = act()
        self.poison = Poison()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = act()
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.poison(self.act1(self.fc1(x)))
        return self.fc3(self.act2(self.fc2(x)))


def batch(
    step: int, n: int = 32, d_in: int = 8, d_out: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randint(0, d_out, (n,), generator=g)


def train(
    model: nn.Module,
    monitor: object,
    steps: int,
    *,
    lr: float = 0.05,
    before: Callable[[int], None] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = batch,
) -> torch.optim.Optimizer:
    """SGD steps with ``monitor.step(loss)`` at each boundary; ``before(step)`` may poison."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = inputs(step)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)  # type: ignore[attr-defined]
    return optimizer


def train_skipping_nan(
    model: Net, optimizer: torch.optim.Optimizer, steps: int, bad: int
) -> list[bool]:
    """A loop that checks its gradients and skips ``optimizer.step()`` when one is NaN/Inf
    (the poison makes NaN gradients at step ``bad``); per step: was an update applied?"""
    applied = []
    for step in range(steps):
        model.poison.mode = "backward" if step == bad else None
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            optimizer.step()
        after = model.parameters()
        applied.append(not all(torch.equal(b, p) for b, p in zip(before, after, strict=True)))
    return applied
