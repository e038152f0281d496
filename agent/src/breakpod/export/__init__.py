"""Exporters: the monitors' per-step statistics and anomalies, in TensorBoard or MLflow.

    exporter = breakpod.export.tensorboard("runs/exp1")    # or a SummaryWriter
    exporter = breakpod.export.mlflow()                    # into the active run

Each logs, at every monitor read: the loss, the global and per-module
gradient norms, counts of tensors that held a NaN/Inf per module, each anomaly
(a ``…/anomaly/<rule>`` point and a text line) and each skipped step. A
non-finite value is never written raw and never disguised: its series gets a
companion ``…/nonfinite`` = 1 plus ``…/nonfinite/nan|posinf|neginf`` = 1.
The backends are optional extras, imported only here. Bad input (a folder that
cannot be written, no MLflow run) is one line on stderr, and a disabled exporter
comes back: training goes on.
"""

from __future__ import annotations

from typing import Any

from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError
from breakpod.export._exporter import Exporter


def tensorboard(writer_or_logdir: Any) -> Exporter:
    """Export to TensorBoard: a ``SummaryWriter`` (torch or tensorboardX) or a log folder."""
    from breakpod.export import _tensorboard

    return _open("tensorboard", lambda: _tensorboard.open_writer(writer_or_logdir))


def mlflow(run: Any = None) -> Exporter:
    """Export to MLflow: ``run`` (a run or a run id), or the active run."""
    from breakpod.export import _mlflow

    return _open("mlflow", lambda: _mlflow.open_writer(run))


def _open(name: str, make: Any) -> Exporter:
    try:
        writer = make()
    except ConfigError as e:
        announce(f"export.{name}: {e}; nothing is exported, training goes on")
        return Exporter(name, None)
    except Exception as e:  # the backend's own failure (store unreachable, bad URI)
        announce(f"export.{name}: {type(e).__name__}: {e}; nothing is exported, training goes on")
        return Exporter(name, None)
    return Exporter(name, writer)


__all__ = ["Exporter", "mlflow", "tensorboard"]
