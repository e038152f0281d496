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
