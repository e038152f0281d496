"""Helpers for the deployment tests: render the real chart with Helm's Go SDK."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "breakpod"

try:  # the broker distribution, once installed; its sources until then
    import breakpod_broker.admission  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "broker" / "src"))

try:
    import helm_python as helm
except ImportError:  # the test modules skip with the reason
    helm = None


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt left out)."""
    docs = []
    for name, text in rendered.items():
        if name.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> dict[str, str]:
    with helm.Chart.load(str(chart)) as loaded:
        result: dict[str, str] = loaded.render(values or {}, name="bp", namespace="breakpod")
        return result


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name):
            return d
    raise AssertionError(f"no {kind} {name or ''} in the render")


TRAINER_JOB = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: train
spec:
  template:
    metadata:
      labels: {breakpod.dev/inject: "true"}
    spec:
      {{- $args := dict "root" . "spec" .Values.podSpec "container" .Values.container }}
      {{- include "breakpod.debugPod" $args | nindent 6 }}
"""

TRAINER_FRAGMENTS = """\
apiVersion: v1
kind: Pod
metadata:
  name: fragments
spec:
  {{- include "breakpod.debugPod" . | nindent 2 }}
  restartPolicy: Never
  containers:
    - name: train
      image: train:1
      {{- include "breakpod.debugContainer" . | nindent 6 }}
"""


@pytest.fixture(scope="session")
def trainer_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A user's chart with breakpod as a dependency, using the named templates."""
    root = tmp_path_factory.mktemp("trainer") / "trainer"
    (root / "templates").mkdir(parents=True)
    (root / "Chart.yaml").write_text(
        "apiVersion: v2\nname: trainer\nversion: 0.1.0\n"
        "dependencies:\n  - name: breakpod\n    version: 0.1.0\n"
    )
    (root / "values.yaml").write_text(
        "podSpec: {containers: [{name: a, image: a}]}\ncontainer: ''\n"
    )
    (root / "templates" / "job.yaml").write_text(TRAINER_JOB)
    (root / "templates" / "fragments.yaml").write_text(TRAINER_FRAGMENTS)
    shutil.copytree(CHART, root / "charts" / "breakpod")
    yield root
