"""The MLflow writer: one ``log_batch`` per read into a run (the active one by default).

MLflow names metrics like paths (its file store keeps each one as a file), so
this writer joins name parts with ``.``: ``breakpod.loss`` and its companion
``breakpod.loss.nonfinite`` never collide as file and folder.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from breakpod._core.errors import ConfigError

INSTALL = "pip install 'breakpod[mlflow]'"
BATCH = 1000  # MLflow's limit of metrics per log_batch call
TAG_LIMIT = 5000  # characters of a tag value kept


class MlflowWriter:
    sep = "."

    def __init__(self, client: Any, run_id: str, entities: Any) -> None:
        self._client = client
        self.run_id = run_id
        self._entities = entities  # mlflow.entities: Metric, RunTag

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + BATCH])

    def text(self, step: int, tag: str, text: str) -> None:
        """A run tag per step (MLflow has no per-step text): ``breakpod.anomalies.step_41``."""
        key = f"{tag.replace('/', self.sep)}{self.sep}step_{step}"
        self._client.set_tag(self.run_id, key, text[:TAG_LIMIT])

    def close(self) -> None:
        """Every call above was synchronous: nothing is left to flush."""


def open_writer(run: Any = None) -> MlflowWriter:
    """A writer into ``run`` (a run, an active run or a run id) or the active run."""
    try:
        import mlflow
        from mlflow import entities
    except ImportError as e:
        raise ConfigError(f"MLflow is not installed ({e}): {INSTALL}") from e
    run = run if run is not None else mlflow.active_run()
    if run is None:
        raise ConfigError("no MLflow run: call mlflow.start_run() first, or pass run=")
    run_id = run if isinstance(run, str) else getattr(getattr(run, "info", None), "run_id", None)
    if not run_id:
        raise ConfigError(f"run={run!r}: expected an MLflow run or a run id")
    client = mlflow.MlflowClient()
    client.get_run(run_id)  # a wrong id fails here, once, not at every read
    return MlflowWriter(client, run_id, entities)
