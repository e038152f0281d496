"""Where this process runs (CI, Kubernetes, a container) and how to reach its ports.

Used by the pytest plugin's attach instructions and by ``breakpod doctor``;
detection reads only the environment and a few files, never the network.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from breakpod._core import net
from breakpod._core.config import FALSE

# name -> the variable that marks it; the first match wins, plain CI=true last.
CI_SYSTEMS = (
    ("GitHub Actions", "GITHUB_ACTIONS"),
    ("GitLab CI", "GITLAB_CI"),
    ("Buildkite", "BUILDKITE"),
    ("CircleCI", "CIRCLECI"),
    ("Jenkins", "JENKINS_URL"),
    ("Azure Pipelines", "TF_BUILD"),
    ("CI", "CI"),
)
CONTAINER_MARKS = ("docker", "containerd", "kubepods", "libpod", "lxc")  # cgroups


@dataclasses.dataclass(frozen=True)
class Hosting:
    ci: str | None = None
    kubernetes: bool = False
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None  # the runtime's name ("docker", ...), None outside one
    hostname: str = ""

    @property
    def github(self) -> bool:
        return self.ci == "GitHub Actions"

    @property
    def gitlab(self) -> bool:
        return self.ci == "GitLab CI"


def detect(environ: Mapping[str, str] | None = None, root: Path = Path("/")) -> Hosting:
    env = os.environ if environ is None else environ
    return Hosting(
        ci=ci_name(env),
        kubernetes=bool(env.get("KUBERNETES_SERVICE_HOST")),
        pod=env.get("POD_NAME") or None,
        namespace=env.get("POD_NAMESPACE") or None,
        container=container_runtime(root),
        hostname=env.get("HOSTNAME") or os.uname().nodename,
    )


def ci_name(env: Mapping[str, str]) -> str | None:
    for name, var in CI_SYSTEMS:
        if env.get(var, "").strip().lower() not in FALSE:
            return name
    return None


def container_runtime(root: Path = Path("/")) -> str | None:
    if (root / ".dockerenv").exists():
        return "docker"  # the container engine
    if (root / "run/.containerenv").exists():
        return "podman"
    try:
        cgroup = (root / "proc/1/cgroup").read_text(errors="replace")
    except OSError:
        return None
    return next((mark for mark in CONTAINER_MARKS if mark in cgroup), None)


def reach_hints(hosting: Hosting, host: str, port: int) -> list[str]:
    """Ways to reach ``host:port`` from the engineer's machine, most specific first."""
    attach = f"breakpod attach 127.0.0.1:{port}"
    hints = []
    if hosting.kubernetes:
        pod = hosting.pod or hosting.hostname or "<pod>"
        ns = f" -n {hosting.namespace}" if hosting.namespace else ""
        hints.append(f"kubectl port-forward{ns} pod/{pod} {port}:{port}  then  {attach}")
    elif hosting.container in ("docker", "podman"):  # container engines
        hints.append(f"{hosting.container} exec -it {hosting.hostname} {attach}")
    if net.is_wildcard(host):
        hints.append(f"from another machine: breakpod attach <this host>:{port} (token required)")
    elif not hosting.kubernetes and not hosting.container:
        hints.append(f"on this machine (ssh to the runner first): {attach}")
    return hints
