"""Lightning's DDP runs ``training_step`` through the LightningModule's forward, patched
onto it for that one call (its ``_ForwardRedirection``, run here in one process around a
plain wrapper): the replay runs that patch again, where it once called the real forward
(``NotImplementedError``), or, once seen, no step was captured at all."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies.strategy import _ForwardRedirection

import breakpod
from breakpod._monitor.timetravel import replay


class Poisoned(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out * float("nan") if self.bad else out


class Module(pl.LightningModule):  # no forward of its own, as many have
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.block = Poisoned()
        self.head = torch.nn.Linear(8, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(torch.relu(self.block(self.encoder(x))))
        return torch.nn.functional.cross_entropy(logits, y)


class Wrapper(torch.nn.Module):  # what DDP is to the module it holds: it calls it
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: object) -> torch.Tensor:
        return self.module(*args)


@pytest.mark.timeout(60)
def test_a_step_run_through_a_patched_forward_is_replayed_through_it(tmp_path):
    torch.manual_seed(0)
    module = Module()
    wrapper, redirect = Wrapper(module), _ForwardRedirection()
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    monitor = breakpod.watch(module, replay=True)
    for step in range(4):
        module.block.bad = step == 3  # a fault of the data: the replay makes it again
        batch = torch.randn(16, 8), torch.randint(0, 4, (16,))
        opt.zero_grad()
        redirect(wrapper, module, "training_step", batch, step).backward()
        if step < 3:
            opt.step()
            monitor.step()
    report = monitor.replay()
    assert report.reproduced, report.why_not
    assert report.first is not None and report.first.module == "block", report.lines()
    with pytest.raises(replay.ReplayError, match=r"ran training_step\(\) through the model's"):
        replay.save_bundle(tmp_path / "step.pt", module, monitor.capture)
    monitor.close()
