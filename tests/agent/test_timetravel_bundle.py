"""``replay save`` + ``breakpod replay BUNDLE --model module:factory``; capture off: no hook."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import breakpod
from breakpod._monitor.timetravel import replay
from tests.agent.nets import Net, batch

FACTORY = """
    import torch
    from tests.agent.nets import Net

    def build():  # the bundle holds tensors, not Python attributes: the factory sets those
        model = Net()
        model.poison.mode = "backward"
        return model
"""


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    for var in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_REPLAY", "ENABLE_REMOTE_DEBUG"):
        monkeypatch.delenv(var, raising=False)


def parked_net() -> tuple[Net, breakpod.Monitor]:
    """Four healthy steps, then a step whose backward goes NaN, stopped before its update."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = breakpod.watch(model, replay=True)
    for step in range(5):
        model.poison.mode = "backward" if step == 4 else None
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step < 4:
            opt.step()
            monitor.step()
    return model, monitor


@pytest.mark.timeout(120)
def test_a_saved_step_replays_in_another_process(tmp_path):
    model, monitor = parked_net()
    here = monitor.replay()
    assert here.reproduced and here.first is not None and here.first.phase == "backward"
    path = replay.save_bundle(tmp_path / "step.pt", model, monitor.capture)
    (tmp_path / "factory.py").write_text(textwrap.dedent(FACTORY))
    root = str(__import__("pathlib").Path(__file__).parents[2])
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "breakpod._cli.main",
            "replay",
            str(path),
            "--model",
            "factory:build",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr
    assert "reproduced bit-exactly" in run.stdout, run.stdout
    # sqrt'(0) = 1 / (2 sqrt(0)): the division, blamed on the forward line that made the node
    expected = (
        "first non-finite op: aten.div.Tensor (backward, autograd node SqrtBackward0) "
        "in module 'poison' at nets.py:22 in forward"
    )
    assert expected in run.stdout, run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", "replay", str(path), "--model", "factory"],
        cwd=tmp_path,
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert bad.returncode == 2 and "expected module:factory" in bad.stderr, bad.stderr


def test_replay_off_installs_no_hook_and_says_how_to_turn_it_on():
    model = Net()
    hooks = len(model._forward_pre_hooks)
    monitor = breakpod.watch(model, replay=False)
    watched = len(monitor._root.pre)  # the monitor's own (the batch check)
    assert monitor.capture is None
    with pytest.raises(replay.ReplayError, match="replay=True"):
        monitor.replay()
    monitor.close()
    on = breakpod.watch(model, rules=[{"name": "b", "check": "nonfinite", "action": "break"}])
    assert on.capture is not None  # a parking rule turns capture on by default
    assert len(on._root.pre) == watched + 1  # capture adds exactly one
    on.close()
    assert len(model._forward_pre_hooks) == hooks


Batch = collections.namedtuple("Batch", "x y")


class FromBatch(torch.nn.Module):
    """Takes a namedtuple batch, as many data loaders give."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.net(batch.x)


def batch_step(make_model: Any = None, make_batch: Any = Batch) -> tuple[Any, breakpod.Monitor]:
    """A step on a batch object (a namedtuple by default) whose backward goes NaN,
    captured for replay."""
    torch.manual_seed(0)
    model = (make_model or FromBatch)()
    monitor = breakpod.watch(model, replay=True)
    model.net.poison.mode = "backward"
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(make_batch(x, y)), y).backward()
    return model, monitor


def test_a_namedtuple_batch_replays_as_a_namedtuple():
    """The captured batch was rebuilt as a plain tuple: the replayed forward's ``batch.x``
    raised AttributeError."""
    _, monitor = batch_step()
    found = monitor.replay()
    assert found.reproduced and found.first is not None and found.first.phase == "backward"
    monitor.close()


class RunsCode:
    """Unpickling it writes a file: what a crafted bundle could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.marker.write_text, ("ran",))


def test_a_bundle_is_read_without_running_its_code_unless_trusted(tmp_path):
    marker = tmp_path / "ran.txt"
    crafted = tmp_path / "crafted.pt"
    torch.save({"breakpod_replay": replay.BUNDLE_VERSION, "x": RunsCode(marker)}, crafted)
    with pytest.raises(replay.ReplayError, match="add --trust"):
        replay.replay_bundle(crafted, Net())
    assert not marker.exists()
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("garbage\n")
    with pytest.raises(replay.ReplayError, match="cannot read a replay bundle"):
        replay.replay_bundle(garbage, Net())


def test_a_namedtuple_batch_bundle_needs_trust_and_a_factory_must_make_a_module(tmp_path):
    model, monitor = batch_step()
    path = replay.save_bundle(tmp_path / "step.pt", model, monitor.capture)
    monitor.close()
    with pytest.raises(replay.ReplayError, match="add --trust"):
        replay.replay_bundle(path, FromBatch())
    with pytest.raises(replay.ReplayError, match=r"not a torch\.nn\.Module"):
        replay.replay_bundle(path, 5, trusted=True)
    rebuilt = FromBatch()
    rebuilt.net.poison.mode = "backward"
    found = replay.replay_bundle(path, rebuilt, trusted=True)
    assert found.reproduced and found.first is not None and found.first.phase == "backward"


@dataclasses.dataclass
class DataBatch:
    x: torch.Tensor
    y: torch.Tensor


class FromDataBatch(FromBatch):
    def forward(self, batch: DataBatch) -> torch.Tensor:  # type: ignore[override]
        return self.net(batch.x)


def test_a_dataclass_batch_is_saved_as_itself_and_a_failing_forward_is_one_error(tmp_path):
    """``asdict`` turned the batch into a dict that not even --trust could give back, and
    the model's AttributeError on it came out of ``breakpod replay`` as a traceback."""
    model, monitor = batch_step(FromDataBatch, DataBatch)
    path = replay.save_bundle(tmp_path / "step.pt", model, monitor.capture)
    monitor.close()
    rebuilt = FromDataBatch()
    rebuilt.net.poison.mode = "backward"
    found = replay.replay_bundle(path, rebuilt, trusted=True)
    assert found.reproduced and found.first is not None and found.first.phase == "backward"
    with pytest.raises(replay.ReplayError, match=r"the model's step failed .*TypeError"):
        replay.replay_bundle(path, FromBatchAsTuple(), trusted=True)


class FromBatchAsTuple(FromDataBatch):
    def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return self.net(batch[0])  # a dataclass is not indexable: the user's bug


def test_accumulated_gradients_are_not_compared_with_one_replayed_forward():
    """Every gradient NaN in both: 'reproduced bit-exactly' after one of two forwards."""
    torch.manual_seed(0)
    model = Net()
    monitor = breakpod.watch(model, replay=True)
    model.poison.mode = "backward"
    for micro in range(2):
        x, y = batch(micro)
        torch.nn.functional.cross_entropy(model(x), y).backward()
    found = monitor.replay()
    monitor.close()
    assert found.reproduced is None and "accumulate 2 forwards" in found.why_not


class TwoHeads(torch.nn.Module):
    """Logits and an auxiliary output; the NaN gradient comes back only through the aux."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.aux = Net(d_in=8, d_out=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.aux(h)


def test_a_nan_that_comes_back_through_a_second_output_is_replayed():
    torch.manual_seed(0)
    model = TwoHeads()
    monitor = breakpod.watch(model, replay=True)
    model.aux.poison.mode = "backward"
    x, y = batch(0)
    logits, aux = model(x)
    (torch.nn.functional.cross_entropy(logits, y) + aux.mean()).backward()
    found = monitor.replay()
    monitor.close()
    assert found.reproduced, found.why_not  # only the logits were replayed before
    assert found.first is not None and found.first.phase == "backward"


class Overflows(torch.nn.Module):
    """Finite in float32; past float16's range (65504) under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * 3e4) * 10


def test_a_step_under_autocast_is_replayed_under_it():
    torch.manual_seed(0)
    model = Overflows()
    monitor = breakpod.watch(model, replay=True)
    x, _ = batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert not torch.isfinite(out).all()  # the real step overflowed
    out.float().mean().backward()
    found = monitor.replay()
    monitor.close()
    assert (found.first or found.first_any) is not None, "replayed in float32: no overflow"
