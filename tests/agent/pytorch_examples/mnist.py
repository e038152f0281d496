"""pytorch/examples mnist/main.py: the model, as the example defines it (BSD-3-Clause)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MNIST-shaped data: 1x28x28 images, normalised as the example does."""
    g = torch.Generator().manual_seed(step)
    x = (torch.rand(n, 1, 28, 28, generator=g) - 0.1307) / 0.3081
    return x, torch.randint(0, 10, (n,), generator=g)
