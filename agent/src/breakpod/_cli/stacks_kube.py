"""``breakpod stacks pod/NAME`` where no kubectl is (a pod of the cluster): the same pod
lookups, exec and ephemeral container through the official ``kubernetes`` client.

The client is an optional extra (``breakpod[kubernetes]``), imported here only. In a
pod it uses the service account (the chart's optional Role ``stacks.rbac.enabled``
grants pods get/list, pods/exec create, pods/ephemeralcontainers patch); elsewhere
the kubeconfig. kubectl stays the first choice where it exists: its argv is what
``--dry-run`` prints and what a person can run by hand.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Sequence
from typing import Any

from breakpod._cli.stacks_remote import JOB_SELECTORS, Runner, StacksError

SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"  # merges ephemeralContainers by name


def kubernetes() -> Any:
    try:
        import kubernetes
    except ImportError as e:
        raise StacksError(
            "kubectl is not installed here, nor the kubernetes client: install kubectl, "
            "or pip install 'breakpod[kubernetes]'"
        ) from e
    return kubernetes


@functools.cache
def core_api() -> Any:
    """CoreV1Api from the pod's service account, else the kubeconfig (made once)."""
    k8s = kubernetes()
    try:
        k8s.config.load_incluster_config()
    except k8s.config.ConfigException:
        try:
            k8s.config.load_kube_config()
        except (k8s.config.ConfigException, OSError) as e:
            raise StacksError(
                f"no cluster to talk to: not in a pod, and no kubeconfig ({e})"
            ) from e
    return k8s.client.CoreV1Api()


def namespace(given: str | None, sa_file: str = SA_NAMESPACE) -> str:
    if given:
        return given
    try:
        with open(sa_file) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def job_pods(api: Any, name: str, ns: str) -> list[dict[str, Any]]:
    """The pods of a Job, JobSet or PyTorchJob, as kubectl's JSON would list them."""
    for selector in JOB_SELECTORS:
        pods = api.list_namespaced_pod(ns, label_selector=selector.format(name)).items
        if pods:
            plain = [api.api_client.sanitize_for_serialization(p) for p in pods]
            return sorted(plain, key=lambda p: p["metadata"]["name"])
    raise StacksError(f"no pod of a Job, JobSet or PyTorchJob named {name!r} in namespace {ns}")


def exec_probe(api: Any, pod: str, ns: str, container: str | None, timeout: float) -> Runner:
    """A runner (command, timeout) -> stdout that execs in the pod's container."""

    def run(command: Sequence[str], _: float) -> str:
        from kubernetes.stream import stream

        options = {"container": container} if container else {}
        ws = stream(
            api.connect_get_namespaced_pod_exec,
            pod,
            ns,
            command=list(command),
            stdout=True,
            stderr=True,
            stdin=False,
            tty=False,
            _preload_content=False,
            **options,
        )
        ws.run_forever(timeout=timeout * 2 + 30)
        out, err, code = ws.read_stdout(), ws.read_stderr(), ws.returncode
        ws.close()
        if code != 0:
            said = (err.strip().splitlines() or ["no message"])[-1]
            raise StacksError(f"exec in pod/{pod} failed ({code}): {said}")
        return str(out)

    return run


def ephemeral_container(name: str, target: str, image: str, command: Sequence[str]) -> Any:
    """The debug container: the target's PID namespace and SYS_PTRACE, nothing more."""
    k8s = kubernetes().client
    return k8s.V1EphemeralContainer(
        name=name,
        image=image,
        command=list(command),
        target_container_name=target,
        security_context=k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["SYS_PTRACE"])),
        stdin=False,
        tty=False,
    )


def debug_probe(api: Any, pod: str, ns: str, target: str, image: str, timeout: float) -> Runner:
    """A runner that adds an ephemeral container running the command, waits for it to
    end, and returns its log."""

    def run(command: Sequence[str], _: float) -> str:
        name = f"breakpod-stacks-{secrets.token_hex(3)}"
        spec = ephemeral_container(name, target, image, command)
        body = {"spec": {"ephemeralContainers": [api.api_client.sanitize_for_serialization(spec)]}}
        api.patch_namespaced_pod_ephemeralcontainers(pod, ns, body, _content_type=STRATEGIC_MERGE)
        wait_terminated(api, pod, ns, name, timeout * 2 + 60)
        return str(api.read_namespaced_pod_log(pod, ns, container=name))

    return run


def wait_terminated(api: Any, pod: str, ns: str, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = api.read_namespaced_pod(pod, ns).status.ephemeral_container_statuses or []
        state = next((s.state for s in statuses if s.name == name), None)
        if state is not None and state.terminated is not None:
            return
        time.sleep(0.5)
    raise StacksError(f"pod/{pod}: the debug container {name} did not end within {timeout:g}s")
