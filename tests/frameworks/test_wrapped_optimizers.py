"""watch(optimizer=...) hooks what actually steps under the wrappers frameworks hand out:
a NaN gradient is judged before the update (a skip rule leaves the weights finite)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import breakpod
from tests.agent.nets import Net, batch

SKIP_NAN = [{"name": "nan-skip", "check": "nonfinite", "action": ["log", "skip"]}]


def run_with(model: torch.nn.Module, wrapped: Any, steps: int = 4) -> breakpod.Monitor:
    """Train through the wrapper's step(); step 2's gradients are NaN."""
    monitor = breakpod.watch(model, SKIP_NAN, optimizer=wrapped)
    for step in range(steps):
        model.poison.mode = "backward" if step == 2 else None  # type: ignore[union-attr]
        x, y = batch(step)
        wrapped.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        wrapped.step()
    return monitor


def accelerated(model: torch.nn.Module) -> Any:
    accelerate = pytest.importorskip("accelerate")
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    accelerator = accelerate.Accelerator(cpu=True)
    _, optimizer = accelerator.prepare(model, sgd)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    return optimizer


class SchedulerStepping:
    """What a loop holds when it passes a scheduler (swa_utils.SWALR) for the optimizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.optim.swa_utils import SWALR

        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        self.scheduler = SWALR(self.optimizer, swa_lr=0.05)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


@pytest.mark.timeout(120)
def test_an_accelerated_optimizer_is_judged_before_its_update() -> None:
    """AcceleratedOptimizer raised AttributeError ('_optimizer_step_pre_hooks') into training
    (LightningOptimizer: tests/frameworks/test_lightning.py, in a real Trainer)."""
    torch.manual_seed(0)
    model = Net()
    monitor = run_with(model, accelerated(model))
    assert monitor.step_count == 4 and monitor.skipped_steps == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert [(a.rule, a.step, a.skipped) for a in monitor.anomalies] == [("nan-skip", 2, True)]
    monitor.close()


def test_an_lr_scheduler_passed_for_the_optimizer_hooks_the_one_it_drives() -> None:
    torch.manual_seed(0)
    model = Net()
    loop = SchedulerStepping(model)
    monitor = breakpod.watch(model, SKIP_NAN, optimizer=loop.scheduler)
    for step in range(4):
        model.poison.mode = "backward" if step == 2 else None
        x, y = batch(step)
        loop.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        loop.step()
    assert monitor.step_count == 4 and monitor.skipped_steps == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    monitor.close()


ZERO = """
    import os, torch, torch.distributed as dist
    import breakpod
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from tests.agent.nets import Net, batch
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                            rank=0, world_size=1)
    torch.manual_seed(0)
    model = Net()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
    rules = [{"name": "nan-skip", "check": "nonfinite", "action": ["log", "skip"]}]
    monitor = breakpod.watch(model, rules, optimizer=opt)
    for step in range(4):
        model.poison.mode = "backward" if step == 2 else None
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("finished", monitor.step_count, monitor.skipped_steps, finite)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_zero_redundancy_optimizer_is_hooked_as_it_is(spawn: Any) -> None:
    from tests.frameworks.jobs import ROOT, free_port

    child = spawn(ZERO, env={"PYTHONPATH": ROOT, "PORT": str(free_port())}, stdin="closed")
    assert child.wait(timeout=100) == 0, child.stderr
    assert "finished 4 1 True" in child.stdout(), child.stderr


def test_what_cannot_be_hooked_is_one_line_and_training_goes_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    class Engine:  # steps, but wraps no torch optimizer (a DeepSpeed-like engine)
        def step(self) -> None: ...

    model = Net()
    monitor = breakpod.watch(model, optimizer=Engine())
    said = [ln for ln in capfd.readouterr().err.splitlines() if "watch(optimizer=" in ln]
    assert len(said) == 1 and "Engine is not a torch.optim.Optimizer" in said[0], said
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    monitor.step()
    assert monitor.step_count == 1
    monitor.close()
