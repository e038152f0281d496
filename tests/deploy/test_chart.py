"""The Helm chart, rendered by Helm's own Go SDK and validated against the
official Kubernetes schemas (strict: no unknown fields)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="pip install -r requirements-dev.txt")

from tests.deploy.conftest import (
    CHART,
    REQUIRED,
    documents,
    find,
    helm,
    merged,
    render,
    render_scenario,
)

kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate")

SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
OLDEST_KUBE = "1.27.0"  # Chart.yaml kubeVersion  # no official schema; checked by shape below


def scenario(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def test_scenarios_exist() -> None:
    assert len(SCENARIOS) >= 4


def test_lint_is_clean() -> None:
    report = helm.lint(str(CHART), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_lints(path: Path) -> None:
    report = helm.lint(str(CHART), merged(REQUIRED, scenario(path)), strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_renders_valid_manifests(path: Path) -> None:
    docs = documents(render_scenario(path))
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            assert doc["spec"] and doc["metadata"]["name"], doc
            continue
        for version in (OLDEST_KUBE, kv.latest_version()):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                where = f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version})"
                pytest.fail(f"{where}: {e.message} at {list(e.path)}")


def overlay_of(rendered: dict[str, str]) -> dict[str, Any]:
    cm = find(documents(rendered), "ConfigMap", "bp-breakpod-overlay")
    data: dict[str, Any] = json.loads(cm["data"]["overlay.json"])
    return data


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_default_overlay_has_the_debug_settings() -> None:
    overlay = overlay_of(render())
    assert overlay["pod"] == {}  # runtimeClassName is opt-in
    c = overlay["container"]
    assert c["tty"] is True and c["stdin"] is True
    assert "livenessProbe" in c and c["livenessProbe"] is None  # removed: parked != dead
    assert c["ports"] == [{"name": "breakpod-dbg", "containerPort": 5678, "protocol": "TCP"}]
    env = env_of(c)
    assert env["ENABLE_REMOTE_DEBUG"] == "1"
    assert env["PYTHONBREAKPOINT"] == "breakpod.set_trace"
    assert env["BREAKPOD_BROKER_URL"] == "http://bp-breakpod.breakpod.svc:8765"
    assert env["BREAKPOD_HOST"] == "127.0.0.1"
    assert "BREAKPOD_LISTENER_TOKEN" not in env  # loopback: kubectl port-forward, no token
    assert env["BREAKPOD_AGENT_TOKEN"] == {
        "secretKeyRef": {"name": "breakpod-agent-token", "key": "token", "optional": True}
    }
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_overlay_options() -> None:
    values = {
        "overlay": {
            "runtimeClassName": "",
            "livenessProbe": "keep",
            "port": 6000,
            "brokerUrl": "http://b:1",
            "tokenSecret": {"name": ""},
        }
    }
    overlay = overlay_of(render(values))
    assert overlay["pod"] == {}
    assert "livenessProbe" not in overlay["container"]
    assert overlay["container"]["ports"][0]["containerPort"] == 6000
    env = env_of(overlay["container"])
    assert env["BREAKPOD_PORT"] == "6000" and env["BREAKPOD_BROKER_URL"] == "http://b:1"
    assert "BREAKPOD_AGENT_TOKEN" not in env


def test_broker_pod_is_hardened_and_probed() -> None:
    docs = documents(render({"webhook": {"enabled": True}}))
    [broker] = find(docs, "Deployment", "bp-breakpod")["spec"]["template"]["spec"]["containers"]
    [webhook] = find(docs, "Deployment", "bp-breakpod-webhook")["spec"]["template"]["spec"][
        "containers"
    ]
    assert broker["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert broker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for c in (broker, webhook):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
        assert not sc["allowPrivilegeEscalation"]
        assert c["resources"]["limits"]
    hook = find(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["objectSelector"] == {"matchLabels": {"breakpod.dev/inject": "true"}}
    assert hook["namespaceSelector"] == {"matchLabels": {"breakpod.dev/inject": "enabled"}}
    assert hook["clientConfig"]["service"]["path"] == "/admission/mutate"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"webhook": {"enabled": True, "replicaCount": 0}}, "/webhook/replicaCount"),
        ({"redis": {"enabled": False}}, "redis.url"),
        ({"redis": {"url": "redis://r:6379/0"}}, "redis.enabled"),
        (
            {"redis": {"enabled": False, "url": "redis://r", "existingSecret": "s"}},
            "redis.existingSecret",
        ),
        (
            {"webhook": {"enabled": True, "tls": {"certManager": {"enabled": False}}}},
            "webhook.tls.secretName",
        ),
        (
            {
                "webhook": {
                    "enabled": True,
                    "tls": {"certManager": {"enabled": False}, "secretName": "s"},
                }
            },
            "webhook.tls.caBundle",
        ),
        (
            {"overlay": {"listenHost": "0.0.0.0", "tokenSecret": {"name": ""}}},
            "overlay.tokenSecret.name",
        ),
        ({"overlay": {"port": 8765}}, "overlay.port"),
        ({"broker": {"replicaCount": -1}}, "/broker/replicaCount"),
        ({"overlay": {"livenessProbe": "sometimes"}}, "/overlay/livenessProbe"),
        ({"overlay": {"portName": "a-port-name-that-is-too-long"}}, "/overlay/portName"),
        ({"brokr": {}}, "brokr"),
    ],
)
def test_nonsense_values_fail_naming_the_value(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert named in str(e.value)


def test_every_value_is_documented() -> None:
    """Each value has a `# --` comment block, or sits inside a documented map."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match[1]), match[2], match[3].strip()
        stack = [s for s in stack if s[0] < indent]
        documented = _comment_above(lines, i) or any(doc for _, doc in stack)
        if rest and not rest.startswith("#") and not documented:  # a leaf
            undocumented.append(key)
        stack.append((indent, documented))
    assert not undocumented, f"values.yaml keys without a '# --' description: {undocumented}"


def _comment_above(lines: list[str], i: int) -> bool:
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("#"):
        if lines[j].strip().startswith("# --"):
            return True
        j -= 1
    return False


def test_schema_describes_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], values: dict[str, Any], path: str) -> None:
        props = node.get("properties", {})
        for key, value in values.items():
            assert key in props, f"{path}{key} is not in values.schema.json"
            assert props[key].get("description"), f"{path}{key} has no description"
            if props[key].get("properties") and isinstance(value, dict):
                walk(props[key], value, f"{path}{key}.")

    walk(schema, defaults, "")
