"""The MLflow exporter against a real MLflow file store: no NaN written, no ±Inf clamped."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import breakpod
from tests.agent.nets import Net
from tests.agent.test_export_roundtrip import LOSSES, train

mlflow = pytest.importorskip("mlflow", reason="pip install -r requirements-dev.txt")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A file store of its own (MLflow 3 asks to opt in to those); the URI is put back after."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    yield mlflow.MlflowClient()
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


def history(client: Any, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_mlflow_round_trip_tells_every_point_apart(store: Any) -> None:
    model = Net()
    monitor = breakpod.watch(model, check_every=1)
    with mlflow.start_run() as run, breakpod.export.mlflow() as exporter:
        assert exporter.enabled
        train(monitor, model, LOSSES)
    monitor.close()
    run_id = run.info.run_id
    assert history(store, run_id, "breakpod.loss") == {0: 1.0, 4: 2.0}
    assert history(store, run_id, "breakpod.loss.nonfinite") == {1: 1.0, 2: 1.0, 3: 1.0}
    assert history(store, run_id, "breakpod.loss.nonfinite.nan") == {1: 1.0}
    assert history(store, run_id, "breakpod.loss.nonfinite.posinf") == {2: 1.0}
    assert history(store, run_id, "breakpod.loss.nonfinite.neginf") == {3: 1.0}
    keys = store.get_run(run_id).data.metrics
    assert "breakpod.grad_norm.global" in keys and "breakpod.grad_norm.fc1" in keys
    for key in keys:  # nothing clamped to ±1.797e308, no NaN for the run page to choke on
        assert all(
            math.isfinite(v) and abs(v) < 1e300 for v in history(store, run_id, key).values()
        )
    tags = store.get_run(run_id).data.tags
    assert any(k.startswith("breakpod.anomalies.step_1") for k in tags), sorted(tags)


def test_mlflow_without_a_run_is_one_line_and_training_goes_on(
    store: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    exporter = breakpod.export.mlflow()
    err = capfd.readouterr().err
    assert not exporter.enabled
    lines = [line for line in err.splitlines() if "export.mlflow" in line]
    assert len(lines) == 1 and "mlflow.start_run()" in lines[0], err
    model = Net()
    with breakpod.watch(model) as monitor:
        train(monitor, model, LOSSES)
        assert monitor.step_count == 5


def test_a_run_that_goes_away_stops_the_export_not_training(
    store: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    model = Net()
    monitor = breakpod.watch(model)
    run_id = store.create_run(experiment_id="0").info.run_id  # a run id, not the active run
    exporter = breakpod.export.mlflow(run_id)
    train(monitor, model, [1.0])
    store.delete_run(run_id)  # logging into a deleted run fails in MLflow
    steps = 1
    while exporter.enabled and steps < 100:  # the failure is heard at a write after it
        train(monitor, model, [1.0])
        steps += 1
        time.sleep(0.02)
    monitor.close()
    assert not exporter.enabled and monitor.step_count == steps
    lines = [line for line in capfd.readouterr().err.splitlines() if "mlflow exporter" in line]
    assert len(lines) == 1 and "training goes on" in lines[0]
    assert torch.isfinite(model.fc1.weight).all()


class Rooted(torch.nn.Module):
    """A model with a parameter of its own (named ``<model>`` by the exporter) and a
    child whose name MLflow refuses as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.parts = torch.nn.ModuleDict({"layer:1": torch.nn.Linear(4, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts["layer:1"](x * self.scale)


def test_names_mlflow_refuses_are_written_under_names_it_takes(store: Any) -> None:
    """MLflow refuses ``<`` ``>`` and ``:`` in a metric name: the model's own parameters
    and a ModuleDict key stopped the whole export at the first read."""
    model = Rooted()
    monitor = breakpod.watch(model)
    with mlflow.start_run() as run, breakpod.export.mlflow() as exporter:
        for value in (1.0, math.nan, 2.0):
            loss = model(torch.ones(2, 4)).sum() * value
            loss.backward()
            monitor.step(loss)
            model.zero_grad()
        monitor.flush()
        assert exporter.enabled
    monitor.close()
    keys = store.get_run(run.info.run_id).data.metrics
    assert {"breakpod.grad_norm._model_", "breakpod.grad_norm.parts.layer_1"} <= set(keys)
    assert history(store, run.info.run_id, "breakpod.loss.nonfinite.nan") == {1: 1.0}


def test_a_tracking_server_that_is_down_never_holds_the_training_thread(
    store: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """MLflow retries an unreachable server for minutes before a call fails."""
    from breakpod.export import _mlflow

    monkeypatch.setattr(_mlflow, "OPEN_WAIT", 0.5)
    monkeypatch.setattr(_mlflow, "CLOSE_WAIT", 0.5)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        mlflow.set_tracking_uri(f"http://127.0.0.1:{closed.getsockname()[1]}")
        started = time.monotonic()
        exporter = breakpod.export.mlflow("0123456789abcdef")
        model = Net()
        with breakpod.watch(model) as monitor:
            train(monitor, model, [1.0] * 20)
        exporter.close()
    assert time.monotonic() - started < 10  # MLflow alone: about 4 minutes
    assert monitor.step_count == 20


def test_an_exporter_that_could_not_open_leaves_no_thread_behind(store: Any) -> None:
    before = threading.active_count()
    for _ in range(5):
        assert not breakpod.export.mlflow("0" * 32).enabled  # no such run
    assert threading.active_count() == before
