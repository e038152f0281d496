"""``breakpod stacks pod/NAME`` with no kubectl: the official kubernetes client's typed
objects and requests. No Kubernetes API server can run here: a small HTTP server on
127.0.0.1 stands in for one, answering the few calls made, and records them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (requirements-dev)")

from breakpod._cli import stacks_kube, stacks_remote  # noqa: E402

POD = "llm-w-0-0"
NS = "ml"


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": [{"name": "trainer", "image": "train:1"}]},
    }


class FakeApiServer(BaseHTTPRequestHandler):
    """Answers list pods, patch ephemeralcontainers, read pod, read log; records each."""

    calls: ClassVar[list[tuple[str, str, dict[str, list[str]], str, Any]]] = []
    debug_name = ""

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: Any, kind: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body: Any = None) -> tuple[str, dict[str, list[str]]]:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        kind = self.headers.get("Content-Type", "")
        FakeApiServer.calls.append((self.command, url.path, query, kind, body))
        return url.path, query

    def do_GET(self) -> None:
        path, query = self._record()
        base = f"/api/v1/namespaces/{NS}/pods"
        if path == base:
            names = [POD, "llm-w-0-1"] if "jobset" in query["labelSelector"][0] else []
            self._answer({"apiVersion": "v1", "kind": "PodList", "items": [pod(n) for n in names]})
        elif path == f"{base}/{POD}":
            self._answer({**pod(POD), "status": {"ephemeralContainerStatuses": [self._ended()]}})
        elif path == f"{base}/{POD}/log":
            self._answer('[{"pid": 7, "rank": 0, "threads": []}]\n', "text/plain")

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._record(body)
        FakeApiServer.debug_name = body["spec"]["ephemeralContainers"][0]["name"]
        self._answer(pod(POD))

    def _ended(self) -> dict[str, Any]:
        return {
            "name": FakeApiServer.debug_name,
            "image": "spy:1",
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": 0}},
        }


@pytest.fixture
def api() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeApiServer.calls = []
    config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    try:
        yield kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))
    finally:
        server.shutdown()
        server.server_close()


def test_the_debug_container_is_typed_with_ptrace_and_its_target() -> None:
    command = stacks_remote.probe_command([1], False, 10.0)
    spec = stacks_kube.ephemeral_container("breakpod-stacks-1", "trainer", "spy:1", command)
    assert isinstance(spec, kubernetes.client.V1EphemeralContainer)
    assert kubernetes.client.ApiClient().sanitize_for_serialization(spec) == {
        "name": "breakpod-stacks-1",
        "image": "spy:1",
        "command": command,
        "targetContainerName": "trainer",
        "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}},
        "stdin": False,
        "tty": False,
    }


@pytest.mark.timeout(30)
def test_job_pods_through_the_client(api: Any) -> None:
    pods = stacks_kube.job_pods(api, "llm", NS)
    assert [p["metadata"]["name"] for p in pods] == [POD, "llm-w-0-1"]
    assert pods[0]["spec"]["containers"][0]["name"] == "trainer"
    asked = [c[2]["labelSelector"][0] for c in FakeApiServer.calls]
    assert asked == [s.format("llm") for s in stacks_remote.JOB_SELECTORS[:3]]


@pytest.mark.timeout(30)
def test_a_debug_container_is_added_by_strategic_merge_then_read(api: Any) -> None:
    """The generated client's default for a dict body would be a JSON patch, which the
    API server refuses for this body: the merge is asked for by name."""
    run = stacks_kube.debug_probe(api, POD, NS, "trainer", "spy:1", 5.0)
    command = stacks_remote.probe_command([1], False, 5.0)
    assert run(command, 5.0) == '[{"pid": 7, "rank": 0, "threads": []}]\n'
    verb, path, _, kind, body = FakeApiServer.calls[0]
    assert (verb, path) == ("PATCH", f"/api/v1/namespaces/{NS}/pods/{POD}/ephemeralcontainers")
    assert kind == "application/strategic-merge-patch+json"
    (added,) = body["spec"]["ephemeralContainers"]
    assert added["command"] == command and added["targetContainerName"] == "trainer"
    log = FakeApiServer.calls[-1]
    assert log[1].endswith("/log") and log[2]["container"] == [added["name"]]


def test_the_namespace_defaults_to_the_service_accounts(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("training\n")
    assert stacks_kube.namespace(None, str(tmp_path / "namespace")) == "training"
    assert stacks_kube.namespace("ml", str(tmp_path / "namespace")) == "ml"
    assert stacks_kube.namespace(None, str(tmp_path / "absent")) == "default"
