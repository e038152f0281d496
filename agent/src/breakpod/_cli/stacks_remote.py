"""Where ``breakpod stacks`` runs its probe: here, in a pod, or in a container.

The probe (``stacks_probe.py``, standard library only) is sent as it is:
``python3 -c SOURCE [--native] --timeout S PID...``. In a pod through
``kubectl exec`` when the image has py-spy, else in an ephemeral container
(``kubectl debug --target``, profile ``general``: SYS_PTRACE, the target's PID
namespace) from an image that has it. In a container through ``docker exec``, else
``docker run --pid=container:ID --cap-add SYS_PTRACE`` from such an image. The
CLIs are used, not SDKs, so ``--dry-run`` can print the very argv a person may run
by hand; in a pod with no kubectl, ``stacks_kube.py`` does the same through the
official ``kubernetes`` client.
"""

from __future__ import annotations

import base64
import inspect
import json
import subprocess
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from breakpod._cli import stacks_probe
from breakpod._core.errors import BreakpodError

Runner = Callable[[Sequence[str], float], str]
EPHEMERAL_PROFILE = "general"  # kubectl debug's profile that adds SYS_PTRACE
JOB_SELECTORS = (  # the label each kind of job puts on its pods, newest first
    "batch.kubernetes.io/job-name={}",  # Job (Kubernetes 1.27+)
    "job-name={}",  # Job (older clusters)
    "jobset.sigs.k8s.io/jobset-name={}",  # JobSet
    "training.kubeflow.org/job-name={}",  # PyTorchJob (training-operator v1.7+)
    "pytorch-job-name={}",  # PyTorchJob (older training-operator)
)


class StacksError(BreakpodError):
    """The stacks could not be read; the message says why and what to do."""


def probe_command(pids: Sequence[int], native: bool, timeout: float) -> list[str]:
    """``python3 -c CODE``: CODE unpacks ``stacks_probe.py`` (compressed: one short
    argument a person can still paste) and runs it."""
    packed = base64.b64encode(zlib.compress(inspect.getsource(stacks_probe).encode(), 9))
    code = f"import base64,zlib;exec(zlib.decompress(base64.b64decode('{packed.decode()}')))"
    flags = (["--native"] if native else []) + ["--timeout", f"{timeout:g}"]
    return ["python3", "-c", code, *flags, *(str(p) for p in pids)]


@dataclass(frozen=True)
class Host:
    """A place the probe runs in; ``argv`` is empty for this machine."""

    label: str  # pod/NAME, container:ID ('' here)
    prefix: tuple[str, ...] = ()  # the command that enters it, the probe's argv follows
    # runs a command there through an API instead of the CLI of ``prefix`` (stacks_kube)
    client: Runner | None = field(default=None, compare=False)

    def argv(self, pids: Sequence[int], native: bool, timeout: float) -> list[str]:
        return [*self.prefix, *probe_command(pids, native, timeout)]

    def execute(self, command: Sequence[str], timeout: float, run: Runner) -> str:
        if self.client is not None:
            return self.client(command, timeout)
        return run([*self.prefix, *command], timeout)


def kubectl_exec(pod: str, namespace: str | None, container: str | None) -> Host:
    prefix = ["kubectl", "exec", *_ns(namespace), pod, *(["-c", container] if container else [])]
    return Host(f"pod/{pod}", (*prefix, "--"))


def kubectl_debug(pod: str, namespace: str | None, container: str, image: str) -> Host:
    prefix = ["kubectl", "debug", *_ns(namespace), f"pod/{pod}", f"--target={container}"]
    prefix += [f"--image={image}", f"--profile={EPHEMERAL_PROFILE}", "--attach=true", "--quiet"]
    return Host(f"pod/{pod}", (*prefix, "--"))


def docker_exec(container: str) -> Host:
    enter = ("docker", "exec", container)  # the docker CLI
    return Host(f"container:{container[:12]}", enter)


def docker_run(container: str, image: str) -> Host:
    run = ("docker", "run", "--rm")  # the docker CLI
    joins = (f"--pid=container:{container}", "--cap-add=SYS_PTRACE")
    return Host(f"container:{container[:12]}", (*run, *joins, image))


def _ns(namespace: str | None) -> list[str]:
    return ["-n", namespace] if namespace else []


def pods_argv(selector: str, namespace: str | None) -> list[str]:
    return ["kubectl", "get", "pods", *_ns(namespace), "-l", selector, "-o", "json"]


def compose_argv(service: str) -> list[str]:
    label = f"label=com.docker.compose.service={service}"
    return ["docker", "ps", "-q", "--filter", label]  # the docker CLI


def run_cli(argv: Sequence[str], timeout: float) -> str:
    """The command's stdout; its failure as a StacksError with its first error line."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        raise StacksError(f"{argv[0]} is not installed here") from e
    except subprocess.TimeoutExpired as e:
        raise StacksError(f"{argv[0]} {argv[1]} did not end within {timeout:g}s") from e
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise StacksError(f"{argv[0]} {argv[1]} failed: {said}")
    return done.stdout


def collect(
    host: Host, pids: Sequence[int], native: bool, timeout: float, run: Runner = run_cli
) -> list[dict[str, Any]]:
    """The probe's records from ``host``; here, in this process (no python3 needed)."""
    if not host.prefix:
        return stacks_probe.probe(list(pids), native, timeout)
    out = host.execute(probe_command(pids, native, timeout), timeout * 2 + 30, run)
    try:
        records = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise StacksError(f"{host.label}: the probe printed no report: {out.strip()[:200]}") from e
    return [{**r, "host": host.label} for r in records]


def job_pods(name: str, namespace: str | None, run: Runner = run_cli) -> list[dict[str, Any]]:
    """The pods of a Job, JobSet or PyTorchJob called ``name``, by their labels."""
    for selector in JOB_SELECTORS:
        pods = json.loads(run(pods_argv(selector.format(name), namespace), 30.0))["items"]
        if pods:
            return sorted(pods, key=lambda p: p["metadata"]["name"])
    raise StacksError(
        f"no pod of a Job, JobSet or PyTorchJob named {name!r}"
        f"{f' in namespace {namespace}' if namespace else ''}"
    )


def compose_containers(service: str, run: Runner = run_cli) -> list[str]:
    ids = run(compose_argv(service), 30.0).split()
    if not ids:
        raise StacksError(f"no running container of compose service {service!r}")
    return ids


def spy_in_image(host: Host, run: Runner = run_cli) -> bool:
    """Whether the container behind ``host`` has py-spy (then exec will do)."""
    check = (
        "import os,shutil,sys;b=os.path.join(os.path.dirname(sys.executable),'py-spy');"
        "sys.exit(0 if os.access(b,os.X_OK) or shutil.which('py-spy') else 3)"
    )
    try:
        host.execute(["python3", "-c", check], 60.0, run)
    except StacksError:
        return False
    return True
