"""The webhook container's own command: uvicorn serving create_app over TLS,
called the way the API server calls it (HTTPS, trusting only the caBundle)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from breakpod_broker import admission
from breakpod_broker.redis_server import free_port
from tests.deploy.conftest import ROOT
from tests.deploy.test_admission import PODS, review_request

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
OPENSSL = shutil.which("openssl")


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for localhost, as webhook.tls.secretName expects."""

    def run(*args: str) -> None:
        subprocess.run([str(OPENSSL), *args], cwd=d, check=True, capture_output=True, timeout=30)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", "tls.key", "-out", "tls.csr")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "1", "-extfile", "ext.cnf", "-out", "tls.crt")  # fmt: skip
    return d / "ca.crt", d / "tls.crt", d / "tls.key"


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if OPENSSL is None:
        pytest.skip("openssl not installed")
    ca, cert, key = make_certs(tmp_path)
    overlay = tmp_path / "overlay.json"
    overlay.write_text(json.dumps({"pod": {}, "container": {"tty": True, "stdin": True}}))
    port = free_port()
    env = {**os.environ, "BREAKPOD_OVERLAY_FILE": str(overlay)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "broker" / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "breakpod_broker.admission:create_app",
           "--host=127.0.0.1", f"--port={port}", f"--ssl-certfile={cert}", f"--ssl-keyfile={key}",
           "--log-level=warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)
    url = f"https://localhost:{port}"
    try:
        wait_healthy(url, ca, proc)
        yield url, ca
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_healthy(url: str, ca: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, "uvicorn exited"
        try:
            if (
                httpx.get(
                    f"{url}/healthz", verify=ssl.create_default_context(cafile=str(ca)), timeout=1
                ).status_code
                == 200
            ):
                return
        except httpx.TransportError:
            time.sleep(0.1)
    pytest.fail("the webhook did not become healthy within 20 s")


def test_mutate_over_tls(webhook: tuple[str, Path]) -> None:
    url, ca = webhook
    review = review_request(PODS["bare"][0])
    response = httpx.post(
        f"{url}/admission/mutate",
        json=review,
        verify=ssl.create_default_context(cafile=str(ca)),
        timeout=5,
    )
    assert response.status_code == 200
    body = response.json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    patch = json.loads(base64.b64decode(body["response"]["patch"]))
    assert {"op": "add", "path": "/spec/containers/0/tty", "value": True} in patch


def test_the_webhook_speaks_only_tls(webhook: tuple[str, Path]) -> None:
    url, _ = webhook
    with pytest.raises(httpx.TransportError):  # a plain-HTTP server would answer 200 here
        httpx.get(url.replace("https://", "http://", 1) + "/healthz", timeout=5)


def test_a_body_past_any_review_is_refused_unread_and_garbage_is_400(webhook) -> None:
    url, ca = webhook
    verify = ssl.create_default_context(cafile=str(ca))
    with httpx.Client(verify=verify, timeout=30) as client:
        huge = b'{"x": "' + b"a" * (admission.MAX_REVIEW_BYTES + 1) + b'"}'
        assert client.post(f"{url}/admission/mutate", content=huge).status_code == 413

        def chunks():  # no Content-Length: counted as it streams
            for _ in range(admission.MAX_REVIEW_BYTES // (1 << 20) + 1):
                yield b" " * (1 << 20)

        assert client.post(f"{url}/admission/mutate", content=chunks()).status_code == 413
        deep = b"[" * 100_000 + b"]" * 100_000
        assert client.post(f"{url}/admission/mutate", content=deep).status_code == 400
        assert client.get(f"{url}/healthz").status_code == 200
