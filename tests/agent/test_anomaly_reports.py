"""Where reports go and where post-mortem lands."""

from __future__ import annotations

import pytest

import breakpod
from tests.agent.nets import Net, train

CRASH_IN_TORCH = """
    import torch
    import torch.nn.functional as F
    import breakpod
    breakpod.install_excepthook()

    logits = torch.randn(4, 3)
    target = torch.tensor([0, 1, 2, 7])  # class 7 of 3: torch raises inside nll_loss
    loss = F.nll_loss(logits, target)
"""


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    monkeypatch.delenv("BREAKPOD_BROKER_URL", raising=False)


def test_event_without_a_broker_says_once_where_events_go(capfd):
    model = Net()
    monitor = breakpod.watch(model)
    model.poison.mode = "forward"
    train(model, monitor, 1)
    model.poison.mode = "backward"
    train(model, monitor, 2)
    err = capfd.readouterr().err
    assert err.count("anomaly events: no broker (BREAKPOD_BROKER_URL unset)") == 1, err


def test_post_mortem_opens_in_the_innermost_user_frame_and_says_it_exits(spawn, pdb_client):
    child = spawn(CRASH_IN_TORCH, stdin="closed")
    client = pdb_client(child.park_port(timeout=30))
    banner = client.read_until()
    assert "-> loss = F.nll_loss(logits, target)" in banner, banner
    assert client.command("p target.tolist()").strip() == "[0, 1, 2, 7]"
    client.close()
    assert child.wait(timeout=30) == 1


def test_post_mortem_expiry_says_exiting_not_continuing(spawn):
    child = spawn(CRASH_IN_TORCH, env={"BREAKPOD_HOLD_SECONDS": "0.3"}, stdin="closed")
    assert child.wait(timeout=30) == 1
    assert "nobody attached within 0.3s; exiting with status 1" in child.stderr, child.stderr
