"""What the chart reads from the cluster through `lookup`, rendered cluster-aware
by Helm's Go SDK (helm_python.Config.render, as `helm upgrade` renders).

No Kubernetes API server can run on these machines, so the cluster here is a
stand-in: a loopback HTTP server answering exactly the two requests a
`lookup "v1" "Secret"` makes (the v1 discovery document and a GET of the
Secret), from Secrets a previous render made, and recording every request.
It shows that generated secrets survive an upgrade, and that a render with
every secret given asks the cluster for nothing (what GitOps needs)."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install -r requirements-dev.txt")

from tests.deploy.conftest import CHART, REQUIRED, documents, find, merged, render  # noqa: E402

DISCOVERY = {
    "kind": "APIResourceList",
    "apiVersion": "v1",
    "groupVersion": "v1",
    "resources": [
        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
         "verbs": ["get", "list"]},
    ],
}  # fmt: skip
NOT_FOUND = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound"}
SECRET_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/secrets/([^/]+)")


class Cluster:
    """Secrets by (namespace, name), as base64 `data`; the paths asked for."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.asked: list[str] = []

    def keep(self, docs: list[dict[str, Any]]) -> None:
        """Store the Secrets of a render as the API server would hold them."""
        for d in docs:
            if d["kind"] != "Secret":
                continue
            data = dict(d.get("data") or {})
            for key, value in (d.get("stringData") or {}).items():
                data[key] = base64.b64encode(value.encode()).decode()
            where = (d["metadata"].get("namespace", "breakpod"), d["metadata"]["name"])
            self.secrets[where] = data


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, str]]:
    state = Cluster()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            state.asked.append(path)
            found = SECRET_PATH.fullmatch(path)
            if path == "/api/v1":
                self.reply(200, DISCOVERY)
            elif found and (found[1], found[2]) in state.secrets:
                meta = {"name": found[2], "namespace": found[1]}
                data = state.secrets[(found[1], found[2])]
                self.reply(
                    200, {"kind": "Secret", "apiVersion": "v1", "metadata": meta, "data": data}
                )
            else:
                self.reply(404, {**NOT_FOUND, "code": 404})

        def reply(self, code: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def upgrade_render(api: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The render `helm upgrade` makes: lookup reads the cluster at api."""
    with (
        helm.Config(kube_apiserver=api, kube_token="unused", namespace="breakpod") as config,
        helm.Chart.load(str(CHART)) as chart,
    ):
        rendered = config.render(
            chart, merged(REQUIRED, values), name="bp", namespace="breakpod", is_upgrade=True
        )
    return documents(rendered)


def string_data(docs: list[dict[str, Any]], name: str, namespace: str | None = None) -> Any:
    for d in docs:
        meta = d["metadata"]
        if d["kind"] == "Secret" and (meta["name"], meta.get("namespace")) == (name, namespace):
            return d.get("stringData") or d.get("data")
    raise AssertionError(f"no Secret {name} in {namespace or 'the release namespace'}")


def test_an_upgrade_keeps_the_generated_tokens_and_redis_password(cluster) -> None:
    state, api = cluster
    installed = documents(render())
    state.keep(installed)
    upgraded = upgrade_render(api, {})
    for name in ("bp-breakpod", "bp-breakpod-redis"):
        assert string_data(upgraded, name) == string_data(installed, name), name


def test_an_upgrade_keeps_the_chart_made_webhook_certificate(cluster) -> None:
    state, api = cluster
    values = {"webhook": {"enabled": True}}
    installed = documents(render(values))
    state.keep(installed)
    upgraded = upgrade_render(api, values)
    tls = string_data(installed, "bp-breakpod-webhook-tls")
    assert string_data(upgraded, "bp-breakpod-webhook-tls") == tls
    hook = find(upgraded, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    assert hook["caBundle"] == tls["ca.crt"]  # the API server keeps trusting the same pair


def test_an_upgrade_keeps_each_namespace_agent_token(cluster) -> None:
    state, api = cluster
    values = {"agentTokens": {"namespaces": ["ml-a", "ml-b"]}}
    installed = documents(render(values))
    state.keep(installed)
    upgraded = upgrade_render(api, values)
    for ns in ("ml-a", "ml-b"):
        token = string_data(installed, "breakpod-agent-token", ns)["token"]
        assert string_data(upgraded, "breakpod-agent-token", ns)["token"] == token
    tokens_file = string_data(upgraded, "bp-breakpod-agent-tokens")["tokens.yaml"]
    assert tokens_file == string_data(installed, "bp-breakpod-agent-tokens")["tokens.yaml"]
    assert namespaces_of(yaml.safe_load(tokens_file)) == {"ml-a", "ml-b"}


def namespaces_of(tokens_file: dict[str, Any]) -> set[str]:
    return {ns for spec in tokens_file["tokens"].values() for ns in spec["namespaces"]}


@pytest.mark.parametrize(
    "values",
    [
        yaml.safe_load((CHART / "ci" / "gitops-values.yaml").read_text()),
        {
            "auth": {"tokens": {"agent": "a" * 20, "viewer": "v" * 20, "admin": "d" * 20}},
            "redis": {"password": "p" * 24},
            "agentTokens": {"namespaces": ["ml"], "tokens": {"ml": "m" * 20}},
            "webhook": {"enabled": True},
        },
    ],
    ids=["existing-secrets", "explicit-values"],
)
def test_with_every_secret_given_the_render_asks_the_cluster_nothing(cluster, values) -> None:
    state, api = cluster
    values = merged(values, {"webhook": {"tls": {"certManager": {"enabled": False}}}})
    webhook_tls = {"secretName": "hook-tls", "caBundle": "Y2E="}
    values = merged(values, {"webhook": {"tls": webhook_tls}})
    upgrade_render(api, values)
    assert state.asked == []


def test_left_to_the_chart_the_render_asks_for_each_generated_secret(cluster) -> None:
    state, api = cluster
    upgrade_render(api, {"webhook": {"enabled": True}, "agentTokens": {"namespaces": ["ml"]}})
    secrets = {p for p in state.asked if p != "/api/v1"}
    assert secrets == {
        "/api/v1/namespaces/breakpod/secrets/bp-breakpod",
        "/api/v1/namespaces/breakpod/secrets/bp-breakpod-redis",
        "/api/v1/namespaces/breakpod/secrets/bp-breakpod-webhook-tls",
        "/api/v1/namespaces/ml/secrets/breakpod-agent-token",
    }
