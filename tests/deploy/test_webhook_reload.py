"""The webhook's own server (python -m breakpod_broker.admission): a rotated
certificate is picked up without a restart, and injection goes on; a debug
port already in use moves, with a warning."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from breakpod_broker import admission
from breakpod_broker.redis_server import free_port
from tests.brokerkit import wait_until
from tests.deploy.conftest import ROOT
from tests.deploy.test_admission import PODS, review_request
from tests.deploy.test_webhook_tls import OPENSSL, make_certs, wait_healthy

httpx = pytest.importorskip("httpx")


@pytest.fixture
def reloading_webhook(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    if OPENSSL is None:
        pytest.skip("openssl not installed")
    served, first, second = (tmp_path / d for d in ("served", "first", "second"))
    for d in (served, first, second):
        d.mkdir()
    ca = make_certs(first)[0]
    make_certs(second)
    for name in ("tls.crt", "tls.key"):
        (served / name).write_bytes((first / name).read_bytes())
    overlay = tmp_path / "overlay.json"
    overlay.write_text(json.dumps({"pod": {}, "container": {"tty": True}}))
    port = free_port()
    env = {**os.environ, "BREAKPOD_OVERLAY_FILE": str(overlay)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "broker" / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "breakpod_broker.admission", "--host=127.0.0.1",
           f"--port={port}", f"--certfile={served / 'tls.crt'}",
           f"--keyfile={served / 'tls.key'}", "--reload-seconds=0.2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)
    url = f"https://localhost:{port}"
    try:
        wait_healthy(url, ca, proc)
        yield url, served, tmp_path
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _mutates(url: str, ca: Path) -> bool:
    try:
        response = httpx.post(
            f"{url}/admission/mutate",
            json=review_request(PODS["bare"][0]),
            verify=ssl.create_default_context(cafile=str(ca)),
            timeout=5,
        )
    except httpx.TransportError:
        return False
    patch = json.loads(base64.b64decode(response.json()["response"]["patch"]))
    return {"op": "add", "path": "/spec/containers/0/tty", "value": True} in patch


def test_a_rotated_certificate_is_served_and_injection_goes_on(reloading_webhook) -> None:
    url, served, root = reloading_webhook
    old_ca, new_ca = root / "first" / "ca.crt", root / "second" / "ca.crt"
    assert _mutates(url, old_ca) and not _mutates(url, new_ca)
    for name in ("tls.key", "tls.crt"):  # as a Secret volume update or a renewal does
        (served / name).write_bytes((root / "second" / name).read_bytes())
    wait_until(lambda: _mutates(url, new_ca), timeout=15)
    assert not _mutates(url, old_ca)  # the old certificate is no longer served


def test_a_debug_port_in_use_moves_with_a_warning() -> None:
    overlay = {
        "pod": {"runtimeClassName": "nvidia"},
        "container": {
            "ports": [{"name": "breakpod-dbg", "containerPort": 5678}],
            "env": [{"name": "BREAKPOD_PORT", "value": "5678"}],
        },
    }
    spec = {
        "runtimeClassName": "kata",
        "containers": [
            {"name": "train", "ports": [{"name": "dap", "containerPort": 5678}]},
            {"name": "side", "ports": [{"name": "x", "containerPort": 5679}]},
        ],
    }
    pod = {"metadata": {"labels": {"breakpod.dev/inject": "true"}}, "spec": spec}
    body = {**review_request(spec), "request": {**review_request(spec)["request"], "object": pod}}
    response = admission.review(body, overlay)["response"]
    patch = json.loads(base64.b64decode(response["patch"]))
    assert not any(op["path"] == "/spec/runtimeClassName" for op in patch)  # kata stays
    added = [op["value"] for op in patch if op["path"].startswith("/spec/containers/0/ports/")]
    assert added == [{"name": "breakpod-dbg", "containerPort": 5680}]
    env = [op["value"] for op in patch if op["path"].startswith("/spec/containers/0/env")]
    assert env == [[{"name": "BREAKPOD_PORT", "value": "5680"}]]
    assert any("port 5678 is in use" in w for w in response["warnings"])
    assert any("runtimeClassName 'kata' is kept" in w for w in response["warnings"])


def test_a_half_updated_pair_leaves_the_old_certificate_serving(reloading_webhook) -> None:
    """A new certificate beside the old key (a Secret volume mid-update): the check that
    refuses it must not have installed it already, or no handshake succeeds."""
    url, served, root = reloading_webhook
    old_ca = root / "first" / "ca.crt"
    (served / "tls.crt").write_bytes((root / "second" / "tls.crt").read_bytes())
    time.sleep(1)  # the reloader (every 0.2 s) tries the pair a few times
    assert _mutates(url, old_ca)


def pod_review(spec: dict, overlay: dict | None = None) -> dict:
    pod = {"metadata": {"labels": {"breakpod.dev/inject": "true"}}, "spec": spec}
    body = {**review_request(spec), "request": {**review_request(spec)["request"], "object": pod}}
    return admission.review(body, overlay or PORT_OVERLAY)["response"]


PORT_OVERLAY = {
    "pod": {},
    "container": {
        "ports": [{"name": "breakpod-dbg", "containerPort": 5678}],
        "env": [{"name": "BREAKPOD_PORT", "value": "5678"}],
    },
}


@pytest.mark.parametrize(
    "spec",
    [
        {"containers": [{"name": "t", "ports": [{"containerPort": 65535}]}]},  # no port above
        {"containers": [{"name": "t", "env": {"A": "1"}}]},  # env as a mapping
        {"containers": [{"name": "t", "env": ["A=1"]}]},  # env as strings
    ],
)
def test_a_pod_no_rule_foresaw_is_allowed_unchanged_with_a_warning(spec) -> None:
    """The webhook must never answer 500: the API server would then create the pod
    without the overlay, saying nothing (failurePolicy Ignore), or not at all."""
    overlay = {**PORT_OVERLAY, "container": {**PORT_OVERLAY["container"], "ports": []}}
    if "ports" in spec["containers"][0]:
        overlay = {"pod": {}, "container": {"ports": [{"name": "d", "containerPort": 65535}]}}
    response = pod_review(spec, overlay)
    assert response["allowed"] is True
    if "patch" not in response:
        assert any("left unchanged" in w for w in response["warnings"])
    else:  # the port moved below: 65535 had nowhere to go above
        patch = json.loads(base64.b64decode(response["patch"]))
        assert patch == [
            {
                "op": "add",
                "path": "/spec/containers/0/ports/1",
                "value": {"name": "d", "containerPort": 1024},
            }
        ]


def test_a_native_sidecars_port_is_in_use_too() -> None:
    sidecar = {"name": "proxy", "restartPolicy": "Always", "ports": [{"containerPort": 5678}]}
    response = pod_review({"initContainers": [sidecar], "containers": [{"name": "t"}]})
    assert any("port 5678 is in use" in w for w in response["warnings"])


def test_a_host_network_pod_without_a_listener_token_is_warned_of() -> None:
    response = pod_review({"hostNetwork": True, "containers": [{"name": "t"}]})
    assert any("node's loopback" in w for w in response["warnings"])
    tokened = {**PORT_OVERLAY["container"]}
    tokened["env"] = [*tokened["env"], {"name": "BREAKPOD_LISTENER_TOKEN", "value": "x" * 8}]
    quiet = pod_review({"hostNetwork": True, "containers": [{"name": "t"}]}, {"container": tokened})
    assert not any("node's loopback" in w for w in quiet.get("warnings", []))
