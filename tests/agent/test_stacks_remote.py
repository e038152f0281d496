"""``breakpod stacks pod/NAME``, ``job/NAME``, ``compose:SERVICE``, ``container:ID``: the
exact commands (--dry-run, through the real CLI), the shipped probe run for real as
``python3 -c`` in a child, and job pods found by their labels. No Kubernetes API
server can run here: the pod lists below stand in for its answers, and say so."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from breakpod._cli import stacks_remote as remote

SPY = Path(sys.executable).with_name("py-spy")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", "stacks", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def dry_run(*args: str) -> list[list[str]]:
    done = cli(*args, "--dry-run")
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in done.stdout.splitlines() if not line.startswith("#")]


def probe_tail(pids: Sequence[int] = (1,), timeout: str = "30") -> list[str]:
    return remote.probe_command(pids, False, float(timeout))


def test_pod_through_kubectl_exec() -> None:
    assert dry_run("pod/train-0", "-n", "ml", "-c", "trainer") == [
        ["kubectl", "exec", "-n", "ml", "train-0", "-c", "trainer", "--", *probe_tail()]
    ]


def test_pod_with_an_image_falls_back_to_an_ephemeral_container() -> None:
    done = cli("pod/train-0", "-c", "trainer", "--image", "reg/spy:1", "--dry-run")
    lines = done.stdout.splitlines()
    assert lines[0] == "# pod/train-0: the first when its image has py-spy, else the second"
    debug = shlex.split(lines[2])
    assert debug[: debug.index("--")] == [
        "kubectl",
        "debug",
        "pod/train-0",
        "--target=trainer",
        "--image=reg/spy:1",
        "--profile=general",  # the profile that adds SYS_PTRACE
        "--attach=true",
        "--quiet",
    ]
    assert debug[debug.index("--") + 1 :] == probe_tail()


def test_via_debug_needs_an_image_and_a_container() -> None:
    done = cli("pod/train-0", "--via", "debug", "--dry-run")
    assert done.returncode == 2
    assert done.stderr == (
        "breakpod: error: --via debug needs --image: an image with python3 and py-spy\n"
    )
    done = cli("pod/train-0", "--via", "debug", "--image", "reg/spy:1", "--dry-run")
    assert done.stderr == (
        "breakpod: error: pod/train-0: a debug container needs --container (its target)\n"
    )


def test_containers_through_docker() -> None:
    assert dry_run("container:3f2a", "--native", "--timeout", "5") == [
        ["docker", "exec", "3f2a", *remote.probe_command([1], True, 5.0)]
    ]
    assert dry_run("container:3f2a", "--via", "debug", "--image", "reg/spy:1") == [
        [
            *("docker", "run", "--rm", "--pid=container:3f2a", "--cap-add=SYS_PTRACE"),
            *("reg/spy:1", *probe_tail()),
        ]
    ]


def test_compose_services_are_found_by_their_label() -> None:
    assert remote.compose_argv("trainer") == [
        *("docker", "ps", "-q", "--filter", "label=com.docker.compose.service=trainer")
    ]


def test_no_kubectl_and_no_cluster_is_one_line(tmp_path: Path) -> None:
    """Without kubectl the kubernetes client is used; with no service account and no
    kubeconfig either, one line says so."""
    env = {**os.environ, "PATH": "/nonexistent", "HOME": str(tmp_path)}
    env.pop("KUBECONFIG", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    done = cli("pod/train-0", "-c", "trainer", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        "breakpod: error: no cluster to talk to: not in a pod, and no kubeconfig ("
    )
    assert done.stderr.count("\n") == 1


def test_job_pods_by_the_labels_of_each_kind() -> None:
    """A JobSet's pods: the Job selectors find nothing, the JobSet one finds them.
    (Stands in for the API server's answers: none can run here.)"""
    asked: list[list[str]] = []
    pods = {"jobset.sigs.k8s.io/jobset-name=llm": ["llm-w-0-1", "llm-w-0-0"]}

    def api(argv: Sequence[str], timeout: float) -> str:
        asked.append(list(argv))
        names = pods.get(argv[argv.index("-l") + 1], [])
        return json.dumps({"items": [{"metadata": {"name": n}} for n in names]})

    found = remote.job_pods("llm", "ml", run=api)
    assert [p["metadata"]["name"] for p in found] == ["llm-w-0-0", "llm-w-0-1"]
    assert [a[a.index("-l") + 1] for a in asked] == [
        "batch.kubernetes.io/job-name=llm",
        "job-name=llm",
        "jobset.sigs.k8s.io/jobset-name=llm",
    ]
    assert asked[0] == [*remote.pods_argv("batch.kubernetes.io/job-name=llm", "ml")]
    with pytest.raises(remote.StacksError, match="no pod of a Job, JobSet or PyTorchJob named"):
        remote.job_pods("nope", None, run=api)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not SPY.exists(), reason="py-spy is not installed (requirements-dev.txt)")
def test_the_shipped_probe_runs_as_python3_c(tmp_path: Path) -> None:
    """The very argv a pod gets, run here by a bare python3 that cannot import breakpod."""
    target = subprocess.Popen(
        [sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    try:
        assert target.stdout is not None and target.stdout.readline() == b"1\n"
        env = {"PATH": f"{SPY.parent}:{os.environ['PATH']}", "PYTHONSAFEPATH": "1"}
        host = remote.Host("here", ("env", "-i", *(f"{k}={v}" for k, v in env.items())))
        (record,) = remote.collect(host, [target.pid], native=False, timeout=20.0)
    finally:
        target.kill()
        target.wait(timeout=10)
    assert record["pid"] == target.pid and record["host"] == "here"
    assert record["threads"][0]["frames"][0]["filename"] == "<string>"


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="this interpreter has sys.remote_exec")
def test_attach_pid_before_python_3_14_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", "attach", "--pid", "4242"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert (done.returncode, done.stdout) == (2, "")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert done.stderr == (
        "breakpod: error: attach --pid needs sys.remote_exec (PEP 768, Python 3.14+) in this "
        f"interpreter and the job's; this is Python {version}: read its stacks with "
        "`breakpod stacks --pid 4242`, or start the job under `breakpod run -- ...` to attach "
        "to it later\n"
    )
