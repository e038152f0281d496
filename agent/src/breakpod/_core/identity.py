"""Who this process is, for the broker: pod, node, container, rank, GPU.

Pod/namespace/node come from the downward-API variables the Helm overlay sets
(``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``); otherwise the container id
and hostname say where the process runs.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from breakpod import protocol
from breakpod._core import hosting
from breakpod._core.announce import announce

RUNTIME_ENV = "BREAKPOD_RUNTIME"
CONTAINER_RUNTIME = protocol.DOCKER  # any container runtime hosting detects
CONTAINER_ID = re.compile(r"(?:docker[-/]|containers/|cri-containerd-|crio-)([0-9a-f]{64})")


def describe(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The registration body for ``PUT /v1/sessions/{id}``; unknown fields omitted."""
    env = os.environ if env is None else env
    info: dict[str, Any] = {
        "job": env.get("BREAKPOD_JOB") or _torchrun_job(env) or _job_name(env),
        "pod": _dns_name(env.get("POD_NAME"), protocol.is_dns_subdomain),
        "namespace": _dns_name(env.get("POD_NAMESPACE"), protocol.is_dns_label),
        "node": _dns_name(env.get("NODE_NAME"), protocol.is_dns_subdomain),
        "container": container_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": _int(env.get("RANK")),
        "world_size": _int(env.get("WORLD_SIZE")),
        "local_rank": _int(env.get("LOCAL_RANK")),
        "gpu": env.get("CUDA_VISIBLE_DEVICES") or None,
        "runtime": runtime(env),
        "attach_address": env.get("BREAKPOD_ATTACH_ADDRESS") or None,
        "cwd": _cwd(),
    }
    return {k: v for k, v in info.items() if v is not None}


def _cwd() -> str | None:
    """The working directory: a debugpy launch.json maps the editor's sources onto it."""
    try:
        return os.getcwd()
    except OSError:  # removed under the process
        return None


def session_id(env: Mapping[str, str] | None = None) -> str:
    """``BREAKPOD_SESSION_ID``, else ``<pod or host>-<pid>-<random>``; never a ":"
    (``breakpod attach`` reads a target with a colon as HOST:PORT)."""
    env = os.environ if env is None else env
    chosen = env.get("BREAKPOD_SESSION_ID")
    if not chosen:
        where = env.get("POD_NAME") or socket.gethostname() or "proc"
        chosen = f"{where}-{os.getpid()}-{secrets.token_hex(3)}"
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", chosen).lstrip("._-") or "session"
    return cleaned[:128]


def runtime(env: Mapping[str, str]) -> str:
    """How the broker tells the engineer to reach this process.

    "kubernetes" needs the downward-API pod and namespace (the port-forward
    names them); any container runtime ``hosting`` detects counts as "docker".
    """
    asked = env.get(RUNTIME_ENV, "")
    if asked in protocol.RUNTIMES:
        return asked
    if asked and asked not in _runtimes_said:  # ignored without a word, it was
        _runtimes_said.add(asked)
        announce(
            f"{RUNTIME_ENV}={asked!r} is not one of: {', '.join(protocol.RUNTIMES)}; "
            "detecting the runtime instead"
        )
    if env.get("POD_NAME") and env.get("POD_NAMESPACE"):
        return protocol.KUBERNETES
    return CONTAINER_RUNTIME if hosting.container_runtime() else protocol.DEFAULT_RUNTIME


_runtimes_said: set[str] = set()


def container_id() -> str | None:
    """The first 12 hex digits of this container's id, when cgroups/mounts show one."""
    for source in ("/proc/self/cgroup", "/proc/self/mountinfo"):
        try:
            match = CONTAINER_ID.search(Path(source).read_text(errors="replace"))
        except OSError:
            continue
        if match:
            return match.group(1)[:12]
    return None


def _dns_name(value: str | None, valid: Callable[[str], bool]) -> str | None:
    """``value`` when it is a valid Kubernetes name (the protocol's rule; the broker
    refuses anything else: names end up in kubectl argv), else ``None`` (left out)."""
    return value if value and valid(value) else None


def _job_name(env: Mapping[str, str]) -> str | None:
    if env.get("POD_NAME"):
        return env.get("JOB_NAME") or env["POD_NAME"].rsplit("-", 1)[0]
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return Path(script).stem or None


def _torchrun_job(env: Mapping[str, str]) -> str | None:
    """torchrun's run id (``--rdzv-id``), shared by every rank; "none" is its default."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def _int(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw is not None else -1
    except ValueError:
        return None
    return value if value >= 0 else None
