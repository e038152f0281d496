"""`make e2e-cluster` where no cluster is reachable (as on these machines):
scripts/e2e-cluster.sh skips in one line and exits 0, run for real with the
real kubectl (no API server can run here, so the run past the skip is for
machines that have a cluster; docs/deployment.md says how)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "e2e-cluster.sh"
BASH = shutil.which("bash") or "/bin/bash"


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
  - name: nowhere
    cluster: {{server: "https://127.0.0.1:{port}", insecure-skip-tls-verify: true}}
users:
  - name: nobody
    user: {{token: not-a-token}}
contexts:
  - name: nowhere
    context: {{cluster: nowhere, user: nobody}}
current-context: nowhere
"""


@pytest.mark.skipif(
    not shutil.which("kubectl"), reason="needs kubectl (apt-get install -y kubectl)"
)
def test_an_unreachable_api_server_skips_in_one_line(tmp_path: Path) -> None:
    port = closed_port()
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG.format(port=port))
    env = {**os.environ, "KUBECONFIG": str(config), "HOME": str(tmp_path)}
    result = run(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"e2e-cluster: skipped: no Kubernetes API server reachable (https://127.0.0.1:{port})"
    ]


def test_no_kubeconfig_skips_in_one_line(tmp_path: Path) -> None:
    if not shutil.which("kubectl"):
        pytest.skip("needs kubectl: without it the script skips earlier (tested below)")
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    result = run({**env, "HOME": str(tmp_path)})  # no ~/.kube/config there
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "e2e-cluster: skipped: no KUBECONFIG and no ~/.kube/config"
    ]


def test_no_kubectl_skips_in_one_line(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # the tools the script needs before its checks, not kubectl
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "rm"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    result = run({"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["e2e-cluster: skipped: kubectl is not installed"]


IMAGES = ROOT / "scripts" / "images.sh"


def test_make_images_builds_and_tags_both_images(tmp_path: Path) -> None:
    """scripts/images.sh's docker argv, recorded by a stand-in docker (no
    Docker engine runs on these machines; the Dockerfiles are linted and
    built for real by the compose tests where one does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    (bin_dir / "docker").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(
        [BASH, str(IMAGES)],
        env={**env, "REGISTRY": "registry.example.com/ml/"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    version = yaml.safe_load((ROOT / "helm/breakpod/Chart.yaml").read_text())["appVersion"]
    broker, debug = log.read_text().replace(version, "VERSION").splitlines()
    assert broker == (
        "build -q --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm "
        "-t registry.example.com/ml/breakpod-broker:VERSION -f docker/broker.Dockerfile ."
    )
    assert debug == (
        "build -q --build-arg BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime "
        "-t registry.example.com/ml/breakpod-debug:VERSION -f docker/debug.Dockerfile ."
    )
    assert "image.repository=registry.example.com/ml/breakpod-broker" in result.stdout
