"""The pod watch's reading of a pod: OOMKilled, Error (exit 1), a signal, Evicted, node
lost, a restarted container's previous death, on the kubernetes client's own V1Pod
objects, deserialized from the JSON an API server returns (no API server can run
where these tests run: the watch itself, in-cluster, runs under make e2e-cluster);
and what it records on the pod's sessions, in a broker with a real Redis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="pip install 'breakpod-broker[kubernetes]'")

from breakpod_broker import app as broker_app  # noqa: E402
from breakpod_broker.pod_watch import PodWatch, deaths_of  # noqa: E402
from breakpod_broker.settings import BrokerSettings  # noqa: E402
from tests.brokerkit import register  # noqa: E402

OLD = "containerd://" + "a1" * 32
NEW = "containerd://" + "b2" * 32
STARTED = "2026-12-03T12:00:00Z"
ENDED = "2026-12-03T12:41:07Z"


def pod(status: dict[str, Any], name: str = "train-0") -> Any:
    """A V1Pod as the client makes it from an API server's answer."""
    doc = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": "5f0c6a3e-1d2b-4c55-9a8e-0b1c2d3e4f50",
        },
        "spec": {"nodeName": "gpu-node-3", "containers": [{"name": "train", "image": "train:1"}]},
        "status": {"phase": "Running", **status},
    }
    return kubernetes.client.ApiClient().deserialize(json.dumps(doc), "V1Pod", "application/json")


def terminated(container_id: str, code: int, reason: str) -> dict[str, Any]:
    done = {"exitCode": code, "reason": reason, "startedAt": STARTED, "finishedAt": ENDED}
    return {
        "name": "train",
        "containerID": container_id,
        "image": "train:1",
        "imageID": "sha256:" + "0" * 64,
        "ready": False,
        "restartCount": 0,
        "state": {"terminated": done},
        "lastState": {},
    }


def read(status: dict[str, Any]) -> list[tuple[str | None, str, dict[str, Any]]]:
    return [(d.container, d.kind, d.fields) for d in deaths_of(pod(status))]


def test_a_container_killed_by_its_memory_limit_is_oomkilled():
    status = {"phase": "Failed", "containerStatuses": [terminated(OLD, 137, "OOMKilled")]}
    assert read(status) == [("a1" * 6, "killed", {"reason": "OOMKilled", "exit": 137})]


def test_an_error_exit_is_a_failure_in_the_kubelets_words():
    status = {"phase": "Failed", "containerStatuses": [terminated(OLD, 1, "Error")]}
    assert read(status) == [("a1" * 6, "finished", {"exit": 1, "reason": "Error (exit 1)"})]


def test_a_signal_and_a_clean_exit():
    killed = {"containerStatuses": [terminated(OLD, 137, "Error")]}
    assert read(killed) == [("a1" * 6, "killed", {"reason": "signal 9 (SIGKILL)", "exit": 137})]
    done = {"phase": "Succeeded", "containerStatuses": [terminated(OLD, 0, "Completed")]}
    assert read(done) == [("a1" * 6, "finished", {"exit": 0})]


def test_an_evicted_pod_and_a_lost_node_reach_every_session_of_the_pod():
    message = "The node was low on resource: memory. Container train was using 30Gi."
    evicted = read({"phase": "Failed", "reason": "Evicted", "message": message})
    assert evicted == [(None, "killed", {"reason": f"Evicted: {message}"})]
    condition = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "DeletionByTaintManager",
        "message": "Taint manager: deleting due to NoExecute taint",
    }
    assert read({"conditions": [condition]}) == [
        (None, "killed", {"reason": "node lost (gpu-node-3)"})
    ]
    assert read({"reason": "NodeLost"}) == [(None, "killed", {"reason": "node lost (gpu-node-3)"})]


def test_a_restarted_container_tells_how_its_previous_process_died():
    restarted = terminated(NEW, 0, "")  # the kubelet names the running container
    restarted["state"] = {"running": {"startedAt": ENDED}}
    previous = terminated(OLD, 137, "OOMKilled")["state"]["terminated"]
    restarted["lastState"] = {"terminated": {**previous, "containerID": OLD}}
    found = read({"containerStatuses": [restarted]})
    assert found == [("a1" * 6, "killed", {"reason": "OOMKilled", "exit": 137})]


def test_a_running_pod_says_nothing():
    running = terminated(NEW, 0, "")
    running["state"] = {"running": {"startedAt": STARTED}}
    assert read({"containerStatuses": [running]}) == []


def test_the_watch_records_each_death_once_on_the_pods_live_sessions(broker):
    kube = {"runtime": "kubernetes", "namespace": "ml", "pod": "train-0", "job": "train"}
    register(broker, "mine", container="a1" * 6, rank=0, **kube)
    register(broker, "restarted", container="b2" * 6, rank=0, **kube)
    register(broker, "elsewhere", runtime="kubernetes", namespace="ml", pod="train-1")
    oom = pod({"phase": "Failed", "containerStatuses": [terminated(OLD, 137, "OOMKilled")]})
    evicted = pod({"phase": "Failed", "reason": "Evicted", "message": "low on memory"})

    async def watch() -> list[int]:
        settings = BrokerSettings(redis_url=broker.redis_url, broker_tokens="", docker_watch="off")
        async with broker_app._running(settings) as running:
            seen = PodWatch(running, api=None, namespaces=["ml"])
            counts = [await seen.handle("ml", oom), await seen.handle("ml", oom)]
            return [*counts, await seen.handle("ml", evicted)]

    assert asyncio.run(watch()) == [1, 0, 1]  # read twice, recorded once
    with broker.client("viewer-token-001") as c:
        found = {s["id"]: s for s in c.get("/v1/sessions").json()["sessions"]}
        events = c.get("/v1/events", params={"kind": "killed"}).json()["events"]
    assert (found["mine"]["state"], found["mine"]["reason"]) == ("killed", "OOMKilled (exit 137)")
    # the same pod's other session (a restarted container) was evicted with it
    assert (found["restarted"]["state"], found["restarted"]["reason"]) == (
        "killed",
        "Evicted: low on memory",
    )
    assert found["elsewhere"]["state"] != "killed"
    assert [(e["session"], e["fields"]["source"]) for e in events] == [
        ("mine", "kubernetes"),
        ("restarted", "kubernetes"),
    ]
