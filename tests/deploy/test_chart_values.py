"""Values a chart user may give by mistake (or on purpose): each fails the render
with the value to fix, rather than rendering pods the API server rejects, YAML
another value wrote, or names Kubernetes refuses. Rendered with the Helm Go SDK."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="pip install -r requirements-dev.txt")

from tests.deploy.conftest import CHART, documents, find, merged, render

WEBHOOK = yaml.safe_load((CHART / "ci" / "webhook-secret-values.yaml").read_text())
TLS = yaml.safe_load((CHART / "ci" / "broker-tls-values.yaml").read_text())
EXTERNAL = {"redis": {"enabled": False, "url": "redis://r:6379/0?password=hunter2"}}


REFUSED = {
    # a port name Kubernetes refuses (no letter; "--"), and one YAML would read as a number
    "a numeric port name": ({"overlay": {"portName": "12345"}}, "portName"),
    "a port name with --": ({"overlay": {"portName": "a--b"}}, "portName"),
    # `--set overlay.extraEnv[0].value=600` gives a number: an env value is a string
    "a number as an env value": (
        {"overlay": {"extraEnv": [{"name": "BREAKPOD_HOLD_SECONDS", "value": 600}]}},
        "extraEnv/0/value",
    ),
    "an env name the overlay sets": (
        {"overlay": {"extraEnv": [{"name": "BREAKPOD_HOST", "value": "0.0.0.0"}]}},
        "BREAKPOD_HOST",
    ),
    "YAML in a service account name": (
        {"serviceAccount": {"create": False, "name": "x\n      hostNetwork: true"}},
        "serviceAccount",
    ),
    "YAML in a secret name": ({"auth": {"existingSecret": "s\n  optional: true"}}, "existing"),
    "YAML in a secret key": ({"redis": {"existingSecretKey": "k: v"}}, "existingSecretKey"),
    "a comma in a token": ({"auth": {"tokens": {"agent": "aaaaaaaa,admin:zzzzzzzz"}}}, "agent"),
    "a password in the Redis URL's query": (EXTERNAL, "password"),
    "a PDB no pod could pass": ({"broker": {"replicaCount": 2, "pdbMinAvailable": 2}}, "pdbMin"),
}


@pytest.mark.parametrize("values, named", REFUSED.values(), ids=REFUSED.keys())
def test_a_value_that_would_break_pods_or_inject_yaml_fails_the_render(values, named) -> None:
    with pytest.raises(Exception, match=named):
        render(values)


def test_the_values_beside_each_refused_one_render() -> None:
    """The checks above refuse the value, not its neighbours."""
    render({"overlay": {"portName": "dbg-2", "extraEnv": [{"name": "X", "value": "600"}]}})
    render({"serviceAccount": {"create": False, "name": "train.sa-1"}})
    render({"broker": {"replicaCount": 3, "pdbMinAvailable": 2}})
    render(merged(WEBHOOK, {"webhook": {"port": 9443}, "service": {"port": 8080}}))
    # the webhook has pods and a Service of its own: the broker's ports are free to it
    render(merged(WEBHOOK, {"webhook": {"port": 8765}, "service": {"port": 443}}))


def test_a_long_release_name_gives_names_kubernetes_takes() -> None:
    docs = documents(render({"fullnameOverride": "a" * 63}))
    redis = find(docs, "StatefulSet")["metadata"]["name"]
    assert len(redis) <= 52  # + "-" + a 10-character revision hash: a 63-character label
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert services and all(len(name) <= 63 for name in services)
    url = next(e for e in _broker_env(docs) if e["name"] == "BREAKPOD_REDIS_URL")["value"]
    assert f"@{redis}:6379" in url  # the broker is told the name the Service has


def test_with_tls_the_helm_test_and_the_notes_speak_https() -> None:
    rendered = render(TLS, api_versions=("cert-manager.io/v1",))
    test_pod = find(documents(rendered), "Pod")
    assert "https://" in " ".join(test_pod["spec"]["containers"][0]["command"])
    notes = rendered["breakpod/templates/NOTES.txt"]
    assert "BREAKPOD_BROKER_URL=https://" in notes and "http://" not in notes


def _broker_env(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    [broker] = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "broker"
    ]
    env: list[dict[str, Any]] = broker["spec"]["template"]["spec"]["containers"][0]["env"]
    return env


def test_as_a_dependency_with_install_false_only_the_overlay_renders(trainer_chart) -> None:
    """A training chart that has breakpod as a dependency for its named templates
    installs no second broker, Redis and webhook per release."""
    central = "https://breakpod.breakpod-system.svc:8765"
    values = {"breakpod": {"install": False, "overlay": {"brokerUrl": central}}}
    docs = documents(render(values, trainer_chart))
    assert sorted(d["kind"] for d in docs) == ["Job", "Pod"]  # the user's own two
    [train] = find(docs, "Job")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["BREAKPOD_BROKER_URL"] == central
    with pytest.raises(Exception, match=r"overlay\.brokerUrl"):
        render({"breakpod": {"install": False}}, trainer_chart)


def test_the_template_refuses_a_debug_port_the_pod_uses(trainer_chart) -> None:
    spec = {"containers": [{"name": "a", "image": "a", "ports": [{"containerPort": 5678}]}]}
    with pytest.raises(Exception, match=r"port 5678 is in use in this pod .*overlay\.port"):
        render({"podSpec": spec, "container": ""}, trainer_chart)
    moved = {"breakpod": {"overlay": {"port": 5680}}, "podSpec": spec, "container": ""}
    docs = documents(render(moved, trainer_chart))
    ports = find(docs, "Job")["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [5678, 5680]
