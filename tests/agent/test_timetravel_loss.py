"""replay on a step whose only non-finite value is the loss: the loss function made it,
outside the model, and the report shows what the model gave it."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch.nn import functional as F

import breakpod
from tests.agent.nets import Net, batch


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def _replay_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[str]:
    model = Net()
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], replay=True)
    x, y = batch(0)
    loss = loss_fn(model(x), y)
    loss.backward()
    monitor.step(loss)
    (a,) = monitor.anomalies
    assert a.phase == "loss", a
    lines = monitor.replay().lines()
    monitor.close()
    return lines


def test_a_loss_only_inf_is_the_loss_functions():
    """The model's output and the gradient it gets back are finite; the loss is -inf."""
    lines = _replay_loss(lambda out, y: F.cross_entropy(out, y) + torch.log(torch.zeros(())))
    text = "\n".join(lines)
    assert "no op produced a non-finite value" not in text, text
    assert "the loss function did, outside the model (step 0: loss is -inf)" in text, text
    assert "  output 0: tensor[32,4] f32" in text, text


def test_a_loss_that_overflows_and_sends_back_an_inf_gradient():
    lines = _replay_loss(lambda out, y: ((out * 1e30) ** 2).mean())
    text = "\n".join(lines)
    assert "the loss function did, outside the model (step 0: loss is inf)" in text, text
    assert "the gradient it sent back into the model's output: tensor[32,4]" in text, text


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
LOSS_JOB = """
    import torch
    import breakpod
    from torch.nn import functional as F
    from tests.agent.nets import Net, batch

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": ["log", "break"]}])
    for step in range(4):
        x, y = batch(step)
        out = model(x)
        loss = F.cross_entropy(out, y) + (torch.log(torch.zeros(())) if step == 2 else 0)
        opt.zero_grad()
        loss.backward()
        monitor.step(loss)
        opt.step()
    print("finished")
"""


@pytest.mark.timeout(120)
def test_replay_at_a_park_shows_the_loss_functions_inputs(spawn, pdb_client):
    child = spawn(LOSS_JOB, env={"PYTHONPATH": ROOT}, stdin="closed")
    client = pdb_client(child.park_port(timeout=60))
    assert "anomaly: step 2 loss" in client.read_until()
    text = client.command("replay")
    assert "the loss function did, outside the model (step 2: loss is -inf)" in text, text
    assert "  output 0: tensor[32,4] f32" in text, text
    assert "    y: tensor[32] i64" in text and "    out: tensor[32,4]" in text, text
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 0, child.stderr
