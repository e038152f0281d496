"""Why a session's pod died, from a watch on its pods (``BREAKPOD_POD_WATCH``).

Off by default. On, the broker watches the pods of ``BREAKPOD_POD_WATCH_NAMESPACES``
(its own namespace when empty) with the official ``kubernetes`` client
(in-cluster config; the chart's ``podWatch.enabled`` grants a namespaced Role:
pods get, list, watch) and records on the pod's sessions what the kubelet and
the node controller say (:func:`deaths_of`): a container terminated OOMKilled,
with an error (``Error (exit 1)``) or by a signal; the pod Evicted; its node
lost. A container is matched to its session by the 12-digit container id the
agent reports; a pod-wide death (eviction, node lost) reaches every session of
the pod. The mapping is tested on the client's own ``V1Pod`` objects, built as
the API server returns them (no API server runs where the tests run).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from breakpod import protocol
from breakpod_broker import keys, reasons
from breakpod_broker.context import Broker

log = logging.getLogger(__name__)
OWN_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # one watch call; then it is made again (the API server ends them too)
RETRY_SECONDS = 5.0
NODE_LOST = "node lost"


class PodWatchError(RuntimeError):
    """BREAKPOD_POD_WATCH is on, and the pods cannot be watched."""


@dataclasses.dataclass(frozen=True)
class Death:
    """One process's end in a pod: its container id (12 hex; None: every session of
    the pod), and the event that says it."""

    container: str | None
    kind: str
    fields: dict[str, Any]
    key: str  # what makes the event's id: the same death read twice is one event


def deaths_of(pod: Any) -> list[Death]:
    """What a V1Pod says of its processes' deaths: pod-wide first, then per container."""
    status = pod.status
    if status is None:
        return []
    found = _pod_wide(pod)
    for container in (status.container_statuses or []) + (status.init_container_statuses or []):
        for state in (container.state, container.last_state):
            done = state.terminated if state is not None else None
            # a restarted container's previous process names its own container id
            ended = (done.container_id or container.container_id) if done is not None else None
            if done is not None and ended:
                found.append(_terminated(ended, done))
    return found


def _pod_wide(pod: Any) -> list[Death]:
    status = pod.status
    reason = status.reason or ""
    if reason == "Evicted":
        said = f"Evicted: {status.message}" if status.message else "Evicted"
        return [Death(None, *reasons.of_exit(None, reason=said), key="evicted")]
    lost = reason == "NodeLost" or any(
        c.type == "DisruptionTarget" and c.reason == "DeletionByTaintManager"
        for c in status.conditions or []
    )
    if lost:
        node = pod.spec.node_name if pod.spec is not None else None
        said = f"{NODE_LOST} ({node})" if node else NODE_LOST
        return [Death(None, *reasons.of_exit(None, reason=said), key="node-lost")]
    return []


def _terminated(container_id: str, done: Any) -> Death:
    """A terminated container state: OOMKilled, Error (exit N), a signal, Completed."""
    short = container_id.rpartition("://")[2][:12]
    code, why = done.exit_code, done.reason or ""
    if why == "OOMKilled":
        kind, fields = reasons.of_exit(code, oom=True)
    elif why and code not in (0, None) and (code or 0) <= 128:  # failed, in the kubelet's words
        kind, fields = (
            protocol.FINISHED,
            {protocol.EXIT_FIELD: code, "reason": f"{why} (exit {code})"},
        )
    else:
        kind, fields = reasons.of_exit(code)
    finished = done.finished_at.timestamp() if done.finished_at is not None else ""
    return Death(short, kind, fields, key=f"{short}-{finished}")


class PodWatch:
    """The replica's watch of its namespaces' pods (a thread per namespace)."""

    def __init__(self, broker: Broker, api: Any, namespaces: list[str]) -> None:
        self.broker = broker
        self.api = api
        self.namespaces = namespaces
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.stopping = threading.Event()
        self.recorded = 0
        self.threads = [
            threading.Thread(target=self._watch, args=(ns,), name=f"pods-{ns}", daemon=True)
            for ns in namespaces
        ]
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, broker: Broker) -> PodWatch | None:
        if not broker.settings.pod_watch:
            return None
        api, namespaces = await asyncio.to_thread(_connect, broker.settings.pod_watch_namespaces)
        watch = cls(broker, api, namespaces)
        for thread in watch.threads:
            thread.start()
        watch.task = asyncio.create_task(watch._handle_all())
        log.info("pod watch: the pods of namespace(s) %s", ", ".join(namespaces))
        return watch

    async def close(self) -> None:
        self.stopping.set()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def _watch(self, namespace: str) -> None:
        from kubernetes import watch  # optional: breakpod-broker[kubernetes]

        while not self.stopping.is_set():
            try:
                for event in watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.api.list_namespaced_pod, namespace, timeout_seconds=WATCH_SECONDS
                ):
                    if self.stopping.is_set():
                        return
                    self.loop.call_soon_threadsafe(self.queue.put_nowait, (namespace, event))
            except Exception as e:  # the API server away, a 410 Gone: watch again
                log.warning("pod watch %s: %s; watching again in %gs", namespace, e, RETRY_SECONDS)
                time.sleep(RETRY_SECONDS)

    async def _handle_all(self) -> None:
        while True:
            namespace, event = await self.queue.get()
            try:
                await self.handle(namespace, event["object"])
            except Exception:  # one odd pod or a Redis error never stops the watch
                log.exception("pod watch: cannot record an event of namespace %s", namespace)

    async def handle(self, namespace: str, pod: Any) -> int:
        """Record each death the pod shows on its live sessions; how many got one."""
        found = deaths_of(pod)
        if not found:
            return 0
        name, uid = pod.metadata.name, pod.metadata.uid or ""
        sessions = await reasons.sessions_where(
            self.broker,
            keys.namespace_sessions(namespace),
            lambda f: f.get("pod") == name and f.get("namespace", "") == namespace,
        )
        recorded = 0
        for death in found:
            mine = await self._of_container(sessions, death.container)
            fields = {**death.fields, "source": protocol.KUBERNETES, "pod": name}
            event_id = f"pod-{uid}-{death.key}"[:160].replace(":", "-").replace("+", "-")
            recorded += await reasons.record(self.broker, mine, death.kind, fields, event_id)
        self.recorded += recorded
        return recorded

    async def _of_container(self, sessions: list[str], container: str | None) -> list[str]:
        if container is None:
            return sessions
        async with self.broker.redis.pipeline(transaction=False) as pipe:
            for session_id in sessions:
                pipe.hget(keys.session(session_id), "container")
            ids = await pipe.execute()
        return [s for s, c in zip(sessions, ids, strict=True) if c in (container, None)]


def _connect(namespaces: str) -> tuple[Any, list[str]]:
    try:
        from kubernetes import client, config  # optional: breakpod-broker[kubernetes]
    except ImportError:
        raise PodWatchError(
            "BREAKPOD_POD_WATCH is on but the kubernetes package is not installed: "
            "pip install 'breakpod-broker[kubernetes]'"
        ) from None
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException as e:
        raise PodWatchError(f"BREAKPOD_POD_WATCH is on but this is not a pod ({e})") from e
    listed = [n.strip() for n in namespaces.split(",") if n.strip()]
    if not listed:
        listed = [OWN_NAMESPACE.read_text().strip()]
    return client.CoreV1Api(), listed
