"""Helpers for the deployment tests: render the real chart with Helm's Go SDK."""

from __future__ import annotations

import json
import re
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
    from helm_python import _native
except ImportError:  # the test modules skip with the reason
    helm = None


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt left out)."""
    docs = []
    for name, text in rendered.items():
        if name.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


# What every install must give and no default can: the broker image (built by
# `make images`, pushed to the user's registry) and the digest of the Redis
# image. Renders below add them unless told not to (images=False); the digest
# is a well-formed placeholder, not a real one.
REQUIRED = {
    "image": {"repository": "registry.example.com/ml/breakpod-broker"},
    "redis": {"image": {"digest": "sha256:" + "ab" * 32}},
}


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of values: later layers win, maps merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if both else value
    return out


def render(
    values: dict[str, Any] | None = None,
    chart: Path = CHART,
    *,
    api_versions: tuple[str, ...] = (),
    images: bool = True,
) -> dict[str, str]:
    """The chart rendered as `helm template bp -n breakpod` would, with the
    cluster's extra API groups in api_versions (`--api-versions`)."""
    values = values or {}
    if images:
        base = REQUIRED if chart == CHART else {"breakpod": REQUIRED}
        values = merged(base, values)
    opts = {"name": "bp", "namespace": "breakpod", "api_versions": list(api_versions)}
    with helm.Chart.load(str(chart)) as loaded:
        # Chart.render has no parameter for the capabilities; the library's
        # render options take them as `helm template --api-versions` does.
        raw = _native.call_string(
            "helm_render", loaded._raw(), json.dumps(values), json.dumps(opts)
        )
        result: dict[str, str] = json.loads(raw)
        return result


def scenario_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    return values


def scenario_api_versions(path: Path) -> tuple[str, ...]:
    """The API groups a scenario's cluster serves: its `# api-versions: A, B` line."""
    found = re.search(r"^# api-versions: (.+)$", path.read_text(), re.M)
    return tuple(v.strip() for v in found[1].split(",")) if found else ()


def render_scenario(path: Path) -> dict[str, str]:
    """A helm/breakpod/ci scenario, rendered for the cluster it describes."""
    return render(scenario_values(path), api_versions=scenario_api_versions(path))


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
