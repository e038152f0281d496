"""The MLflow writer: one ``log_batch`` per read into a run (the active one by default).

MLflow names metrics like paths (its file store keeps each one as a file), so
this writer joins name parts with ``.``: ``breakpod.loss`` and its companion
``breakpod.loss.nonfinite`` never collide as file and folder. A name part MLflow
refuses (a module named ``layer:1`` in a ``ModuleDict``) has ``_`` for each such
character.

A tracking server that is down costs the training thread nothing: MLflow's own
HTTP retries take minutes before a call fails, so the writes run on a thread of
their own, behind a bounded queue. A failure there is raised at the next write
(the exporter then stops, once, saying why); a queue the server cannot keep up
with drops points, and says so once.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from breakpod._core import threads
from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError

INSTALL = "pip install 'breakpod[mlflow]'"
BATCH = 1000  # MLflow's limit of metrics per log_batch call
TAG_LIMIT = 5000  # characters of a tag value kept
NAME_LIMIT = 250  # characters of a metric or tag name MLflow takes
PENDING = 1000  # writes queued for the server; more are dropped
OPEN_WAIT = 5.0  # seconds open_writer waits to hear that the run exists
CLOSE_WAIT = 10.0  # seconds close waits for queued writes (at exit too)
_REFUSED = re.compile(r"[^/\w.\- ]")  # what MLflow's names may not hold


def valid_name(name: str) -> str:
    return _REFUSED.sub("_", name)[:NAME_LIMIT]


class MlflowWriter:
    sep = "."

    def __init__(self, client: Any, run_id: str, entities: Any) -> None:
        self._client = client
        self.run_id = run_id
        self._entities = entities  # mlflow.entities: Metric, RunTag
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue(PENDING)
        self._error: Exception | None = None
        self._dropped = 0
        self._closing = False
        self._raised = False  # the failure was raised to the exporter already
        self._thread = threads.start_daemon(self._drain, "breakpod-mlflow")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(valid_name(k), v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), BATCH):
            batch = metrics[start : start + BATCH]
            self._put(functools.partial(self._client.log_batch, self.run_id, metrics=batch))

    def text(self, step: int, tag: str, text: str) -> None:
        """A run tag per step (MLflow has no per-step text): ``breakpod.anomalies.step_41``."""
        key = valid_name(f"{tag.replace('/', self.sep)}{self.sep}step_{step}")
        self._put(lambda: self._client.set_tag(self.run_id, key, text[:TAG_LIMIT]))

    def check(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the queued writes; raise what failed among them."""
        deadline = time.monotonic() + seconds
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        self._raise()

    def close(self) -> None:
        """Let the queued writes go out, for at most CLOSE_WAIT in all; none after a
        write failed. Raises what failed among them (the exporter says it)."""
        deadline = time.monotonic() + (0.5 if self._error is not None else CLOSE_WAIT)
        try:
            self._queue.put(None, timeout=max(0.01, deadline - time.monotonic()))
        except queue.Full:
            self._closing = True  # the writes still queued are skipped, then the thread ends
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._closing = True  # a write still under way: what follows it is skipped
        self._raise()

    def _put(self, write: Callable[[], object]) -> None:
        self._raise()
        try:
            self._queue.put_nowait(write)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                announce(
                    "mlflow exporter: the tracking server is slower than training; "
                    "points are dropped until it catches up"
                )

    def _raise(self) -> None:
        """Raise a failed write's error, once: the exporter that hears it stops."""
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def _drain(self) -> None:
        while True:
            try:  # once closing, an empty queue is the end (its sentinel may not fit)
                write = self._queue.get(timeout=1.0 if self._closing else None)
            except queue.Empty:
                return
            if write is None:
                return
            try:
                if self._error is None and not self._closing:
                    write()
            except Exception as e:  # raised to the exporter at its next write
                self._error = e
            finally:
                self._queue.task_done()


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
    writer = MlflowWriter(client, run_id, entities)
    writer._put(lambda: client.get_run(run_id))  # a wrong id fails here, not at every read
    try:
        writer.check(OPEN_WAIT)  # ... and is said now, unless the server takes longer
    except Exception:
        with contextlib.suppress(Exception):  # no thread left for an exporter that never was
            writer.close()
        raise
    return writer
