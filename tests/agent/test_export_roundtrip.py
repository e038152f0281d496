"""Exporters: [1, NaN, +Inf, -Inf, 2] written by a real monitor, read back from real
TensorBoard event files and a real MLflow file store, every point told apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import breakpod
from tests.agent.nets import Net

LOSSES = [1.0, math.nan, math.inf, -math.inf, 2.0]


def train(monitor: breakpod.Monitor, model: torch.nn.Module, losses: list[float]) -> None:
    """Real forward/backward steps; the step's loss is the one given (a poisoned value)."""
    for value in losses:
        model.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        monitor.step(torch.tensor(value))


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    pytest.importorskip("tensorboard", reason="pip install -r requirements-dev.txt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_round_trip_tells_every_point_apart(tmp_path: Path) -> None:
    model = Net()
    monitor = breakpod.watch(model, check_every=1)
    with breakpod.export.tensorboard(tmp_path / "tb") as exporter:
        assert exporter.enabled
        train(monitor, model, LOSSES)
    monitor.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["breakpod/loss"] == {0: 1.0, 4: 2.0}  # finite points only, never a NaN
    assert scalars["breakpod/loss/nonfinite"] == {1: 1.0, 2: 1.0, 3: 1.0}
    assert scalars["breakpod/loss/nonfinite/nan"] == {1: 1.0}
    assert scalars["breakpod/loss/nonfinite/posinf"] == {2: 1.0}
    assert scalars["breakpod/loss/nonfinite/neginf"] == {3: 1.0}
    assert set(scalars["breakpod/grad_norm/global"]) == set(range(5))
    assert set(scalars["breakpod/grad_norm/fc1"]) == set(range(5))
    assert all(math.isfinite(v) for series in scalars.values() for v in series.values())
    assert 1 in scalars["breakpod/anomaly/nonfinite"]  # the default rule's anomaly, at its step


def test_tensorboard_counts_nonfinite_tensors_per_module(tmp_path: Path) -> None:
    model = Net()
    monitor = breakpod.watch(model, check_every=2, tier="detailed")  # per module: tier 2
    with breakpod.export.tensorboard(tmp_path / "tb"):
        train(monitor, model, [1.0])
        model.poison.mode = "forward"  # -inf out of `poison` from here on
        train(monitor, model, [1.0, 1.0, 1.0])
    monitor.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["breakpod/nonfinite_tensors/total"][0] == 0.0
    assert scalars["breakpod/nonfinite_tensors/poison"][1] >= 1.0
    assert 0 not in scalars.get("breakpod/nonfinite_tensors/poison", {})


def test_a_writer_passed_in_is_used_and_left_open(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install -r requirements-dev.txt")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    exporter = breakpod.export.tensorboard(writer)
    exporter.log(7, {"mine/accuracy": 0.5, "mine/ppl": math.inf})
    exporter.close()
    writer.add_scalar("mine/after", 1.0, 8)  # still open: the caller owns it
    writer.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["mine/accuracy"] == {7: 0.5}
    assert scalars["mine/ppl/nonfinite/posinf"] == {7: 1.0}
    assert "mine/ppl" not in scalars


def test_a_log_folder_that_cannot_be_written_is_one_line_and_training_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    exporter = breakpod.export.tensorboard(blocker / "tb")
    err = capfd.readouterr().err
    assert not exporter.enabled
    lines = [line for line in err.splitlines() if "export.tensorboard" in line]
    assert len(lines) == 1 and "cannot create the log folder" in lines[0], err
    model = Net()
    with breakpod.watch(model) as monitor:
        train(monitor, model, LOSSES)  # nothing raised
        assert monitor.step_count == 5


def test_a_closed_exporter_hears_nothing_more(tmp_path: Path) -> None:
    model = Net()
    monitor = breakpod.watch(model)
    exporter = breakpod.export.tensorboard(tmp_path / "tb")
    train(monitor, model, [1.0])
    exporter.close()
    before = exporter.points
    train(monitor, model, [2.0])
    monitor.close()
    assert before > 0 and exporter.points == before
    assert set(tensorboard_scalars(tmp_path / "tb")["breakpod/loss"]) == {0}


def test_phase_timings_are_exported_per_read(tmp_path: Path) -> None:
    model = Net()
    monitor = breakpod.watch(model, check_every=2)
    with breakpod.export.tensorboard(tmp_path / "tb"):
        for _ in range(4):
            with breakpod.phase("forward"):
                loss = model(torch.randn(4, 8)).square().mean()
            with breakpod.phase("backward"):
                model.zero_grad()
                loss.backward()
            monitor.step(loss)
    monitor.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars["breakpod/phase/forward/host_ms"]) == {1, 3}  # at each read's last step
    assert all(v > 0 for v in scalars["breakpod/phase/backward/host_ms"].values())


def test_log_leaves_out_what_is_not_a_number_and_names_it_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A None, a string, a tensor of many values or a complex number raised a bare
    TypeError into the training loop, naming no key."""
    with breakpod.export.tensorboard(tmp_path / "tb") as exporter:
        bad = {"none": None, "text": "1.5", "many": torch.tensor([1, 2]), "cplx": 1 + 2j}
        for step in (0, 1):
            exporter.log(step, {"ok": torch.tensor(3.0), **bad})
    said = capfd.readouterr().err.splitlines()
    for name in bad:
        assert sum(f"'{name}'" in line and "left out" in line for line in said) == 1, said
    assert tensorboard_scalars(tmp_path / "tb")["ok"] == {0: 3.0, 1: 3.0}


@pytest.mark.parametrize("order", ["optimizer-then-loss", "check-every-3"])
def test_the_last_step_reaches_the_event_file(tmp_path: Path, order: str) -> None:
    """An 8-step run wrote steps 0-6: the last step's loss (recorded after opt.step(),
    or waiting for a read every 3 steps) was dropped by close(), never read."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if order == "optimizer-then-loss":
        monitor = breakpod.watch(model, optimizer=optimizer)
    else:
        monitor = breakpod.watch(model, check_every=3)
    exporter = breakpod.export.tensorboard(tmp_path / "tb")
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        monitor.step(loss)
        losses.append(loss.item())
    monitor.close()
    exporter.close()
    written = tensorboard_scalars(tmp_path / "tb")["breakpod/loss"]
    assert sorted(written) == list(range(8))
    assert written[7] == pytest.approx(losses[7])
