"""The admission webhook against the named template: same pod spec, idempotent.

A user's chart (breakpod as a dependency) renders its Job through
``breakpod.debugPod``; the same render's overlay ConfigMap feeds the webhook,
which answers real AdmissionReview v1 requests over a real ASGI app.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("helm_python", reason="pip install -r requirements-dev.txt")

from tests.deploy.conftest import documents, find, render

jsonpatch = pytest.importorskip("jsonpatch")
testclient = pytest.importorskip("fastapi.testclient")
kv = pytest.importorskip("kubernetes_validate.utils")

from breakpod_broker import admission, overlay  # noqa: E402

TRAINER = {
    "name": "train",
    "image": "train:1",
    "command": ["python", "train.py"],
    "env": [
        {"name": "LR", "value": "0.1"},
        {"name": "BREAKPOD_PORT", "value": "1234"},
        {"name": "PYTHONBREAKPOINT", "value": "0"},
    ],
    "ports": [{"name": "metrics", "containerPort": 9000}],
    "livenessProbe": {"httpGet": {"path": "/alive", "port": 9000}, "periodSeconds": 5},
    "resources": {"limits": {"cpu": "2", "memory": "4Gi"}},
}
SIDECAR = {"name": "logs", "image": "logs:1", "tty": False}

PODS = {
    "bare": ({"containers": [{"name": "train", "image": "train:1"}]}, ""),
    "own-env-and-probe": ({"containers": [TRAINER], "restartPolicy": "Never"}, ""),
    "sidecar-first": ({"containers": [SIDECAR, TRAINER], "runtimeClassName": "gvisor"}, "train"),
}
OVERLAYS = {
    "defaults": {},
    "cpu-keep-probe": {
        "overlay": {
            "runtimeClassName": "",
            "livenessProbe": "keep",
            "tty": False,
            "extraEnv": [{"name": "BREAKPOD_HOLD_SECONDS", "value": "60"}],
        }
    },
}


def review_request(
    spec: dict[str, Any], *, label: str | None = "true", container: str = ""
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "train-abc", "namespace": "ml", "labels": {}}
    if label is not None:
        meta["labels"]["breakpod.dev/inject"] = label
    if container:
        meta["annotations"] = {overlay.CONTAINER_ANNOTATION: container}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "ml",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec},
        },
    }


def patch_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    body = response["response"]
    assert body["allowed"] is True and body["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    if "patch" not in body:
        return []
    assert body["patchType"] == "JSONPatch"
    patch: list[dict[str, Any]] = json.loads(base64.b64decode(body["patch"]))
    return patch


def helm_render(chart: Path, spec: dict[str, Any], container: str, values: dict[str, Any]):
    rendered = render({"podSpec": spec, "container": container, "breakpod": values}, chart=chart)
    docs = documents(rendered)
    job_spec = find(docs, "Job")["spec"]["template"]["spec"]
    cm = find(docs, "ConfigMap", "bp-breakpod-overlay")
    return job_spec, json.loads(cm["data"]["overlay.json"])


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, trainer_chart: Path):
    """The webhook app (uvicorn's factory), reading the chart's rendered overlay."""
    path = tmp_path_factory.mktemp("overlay") / "overlay.json"
    _, rendered = helm_render(trainer_chart, PODS["bare"][0], "", {})
    path.write_text(json.dumps(rendered))
    mp = pytest.MonkeyPatch()
    mp.setenv(admission.OVERLAY_ENV, str(path))
    with testclient.TestClient(admission.create_app()) as c:
        yield c
    mp.undo()


@pytest.mark.parametrize("values_id", OVERLAYS)
@pytest.mark.parametrize("pod_id", PODS)
def test_webhook_and_named_template_agree(trainer_chart: Path, pod_id: str, values_id: str) -> None:
    spec, container = PODS[pod_id]
    expected, rendered = helm_render(trainer_chart, spec, container, OVERLAYS[values_id])
    request = review_request(copy.deepcopy(spec), container=container)
    patch = patch_of(admission.review(request, rendered))
    assert patch, "a labelled pod gets a patch"
    pod = jsonpatch.apply_patch(request["request"]["object"], patch)
    assert pod["spec"] == expected
    again = review_request(pod["spec"], container=container)
    assert patch_of(admission.review(again, rendered)) == []  # idempotent
    already = review_request(copy.deepcopy(expected), container=container)
    assert patch_of(admission.review(already, rendered)) == []  # overlay from the template


@pytest.mark.parametrize("pod_id", PODS)
def test_debugged_pod_is_a_valid_pod_spec(trainer_chart: Path, pod_id: str) -> None:
    spec, container = PODS[pod_id]
    rendered = render({"podSpec": spec, "container": container, "breakpod": {}}, trainer_chart)
    job = find(documents(rendered), "Job")
    kv.validate(job, kv.latest_version(), strict=True)


def test_helm_template_is_idempotent(trainer_chart: Path) -> None:
    spec, container = PODS["sidecar-first"]
    once, _ = helm_render(trainer_chart, spec, container, {})
    twice, _ = helm_render(trainer_chart, once, container, {})
    assert twice == once
    assert once["runtimeClassName"] == "gvisor"  # the pod's own is never replaced
    train = once["containers"][1]
    assert once["containers"][0] == SIDECAR  # only the chosen container changes
    assert train["tty"] and train["stdin"] and "livenessProbe" not in train
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["BREAKPOD_PORT"] == "5678" and env["PYTHONBREAKPOINT"] == "breakpod.set_trace"
    assert env["LR"] == "0.1"  # the user's own env stays, in place
    assert [p["name"] for p in train["ports"]] == ["metrics", "breakpod-dbg"]


def test_fragment_forms(trainer_chart: Path) -> None:
    default = documents(render({"breakpod": {}}, chart=trainer_chart))
    assert "runtimeClassName" not in find(default, "Pod", "fragments")["spec"]  # opt-in
    opted = {"breakpod": {"overlay": {"runtimeClassName": "nvidia"}}}
    docs = documents(render(opted, chart=trainer_chart))
    pod = find(docs, "Pod", "fragments")["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    c = pod["containers"][0]
    assert c["tty"] and c["stdin"] and c["ports"][0]["containerPort"] == 5678
    assert "livenessProbe" not in c
    assert {"name": "ENABLE_REMOTE_DEBUG", "value": "1"} in c["env"]


def test_over_http(client: Any) -> None:
    spec = PODS["own-env-and-probe"][0]
    labelled = client.post("/admission/mutate", json=review_request(copy.deepcopy(spec)))
    assert labelled.status_code == 200
    pod = jsonpatch.apply_patch(
        review_request(spec)["request"]["object"], patch_of(labelled.json())
    )
    assert pod["spec"]["containers"][0]["tty"] is True
    unlabelled = client.post("/admission/mutate", json=review_request(spec, label=None))
    assert patch_of(unlabelled.json()) == []
    other = client.post("/admission/mutate", json=review_request(spec, label="false"))
    assert patch_of(other.json()) == []


def test_unknown_container_is_allowed_with_a_warning(client: Any) -> None:
    response = client.post(
        "/admission/mutate", json=review_request(PODS["bare"][0], container="nope")
    ).json()
    assert patch_of(response) == []
    assert "breakpod.dev/container='nope'" in response["response"]["warnings"][0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (
            b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}',
            "admission.k8s.io/v1",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
            "request.uid",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []}',
            "request.uid",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",'
            b' "request": {"uid": {"a": 1}}}',
            "request.uid",
        ),
    ],
)
def test_bad_requests_get_400(client: Any, body: bytes, message: str) -> None:
    response = client.post(
        "/admission/mutate", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert message in response.json()["detail"]


MALFORMED = {
    "kind-is-a-string": lambda r: r["request"].update(kind="Pod"),
    "metadata-is-a-list": lambda r: r["request"]["object"].update(metadata=[]),
    "labels-are-a-list": lambda r: r["request"]["object"]["metadata"].update(labels=["x"]),
    "annotations-are-a-string": lambda r: r["request"]["object"]["metadata"].update(
        annotations="x"
    ),
    "spec-is-a-list": lambda r: r["request"]["object"].update(spec=[1]),
    "containers-are-an-object": lambda r: r["request"]["object"]["spec"].update(containers={}),
    "container-is-a-number": lambda r: r["request"]["object"]["spec"].update(containers=[1]),
    "container-name-is-a-list": lambda r: r["request"]["object"]["spec"].update(
        containers=[{"name": ["a"]}]
    ),
    "container-annotation-is-a-number": lambda r: r["request"]["object"]["metadata"].update(
        annotations={"breakpod.dev/container": 3}
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_pods_are_allowed_unchanged_never_an_error(client: Any, case: str) -> None:
    body = review_request(copy.deepcopy(PODS["bare"][0]))
    MALFORMED[case](body)
    response = client.post("/admission/mutate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["response"]["allowed"] is True


def test_missing_overlay_never_blocks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(admission.OVERLAY_ENV, str(tmp_path / "absent.json"))
    response = admission.review(review_request(PODS["bare"][0]), admission.current_overlay())
    assert patch_of(response) == []
    assert "no overlay file" in response["response"]["warnings"][0]


def test_json_patch_escapes_and_removes() -> None:
    before = {"a/b": 1, "c~d": 2, "gone": 3, "keep": [1], "same": [{"x": 1}, {"y": 1}]}
    after = {"a/b": 2, "c~d": 2, "keep": [1, 2], "new": {"x": 1}, "same": [{"x": 1}, {"y": 2}]}
    patch = overlay.json_patch(before, after)
    assert jsonpatch.apply_patch(before, patch) == after
    assert {"op": "replace", "path": "/a~1b", "value": 2} in patch
    assert {"op": "replace", "path": "/same/1/y", "value": 2} in patch
    assert {"op": "remove", "path": "/gone"} in patch
