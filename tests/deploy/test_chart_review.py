"""A cluster reviewer's checklist, run over every scenario in helm/breakpod/ci:
no secret on a command line or in a plain env value, a PodDisruptionBudget and
anti-affinity when replicas > 1, checksum annotations that roll the broker when
its settings change, no forced runtimeClassName, token lengths the broker takes,
a NetworkPolicy both ways for every workload, no image the user did not name or
a digest pin."""

from __future__ import annotations

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
    merged,
    render,
    render_scenario,
    scenario_values,
)

SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
WORKLOADS = ("Deployment", "StatefulSet")
CHECKSUMS = ("checksum/overlay", "checksum/auth", "checksum/redis", "checksum/tls")


def scenario(path: Path) -> list[dict[str, Any]]:
    return documents(render_scenario(path))


def secret_values(docs: list[dict[str, Any]]) -> set[str]:
    """Every value of every Secret the render holds (tokens, passwords)."""
    return {
        v
        for d in docs
        if d["kind"] == "Secret"
        for v in (d.get("stringData") or {}).values()
        if len(v) >= 8
    }


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.fixture(params=SCENARIOS, ids=lambda p: p.name.removesuffix("-values.yaml"))
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return scenario(request.param)


def test_no_secret_on_a_command_line_or_in_a_plain_env_value(docs) -> None:
    secrets = secret_values(docs)
    for doc in (d for d in docs if d["kind"] in WORKLOADS):
        for c in pod_containers(doc):
            argv = " ".join(map(str, c.get("command", []) + c.get("args", [])))
            assert "requirepass" not in c.get("args", []), c["name"]
            assert not [s for s in secrets if s in argv], c["name"]
            for e in c.get("env", []):
                value = str(e.get("value", ""))
                assert not [s for s in secrets if s in value], (c["name"], e["name"])
                assert "@" not in value or "$(" in value, (c["name"], e["name"])  # no user:pw@


def test_a_pdb_and_anti_affinity_exactly_when_there_are_replicas(docs) -> None:
    deployment = find(docs, "Deployment", "bp-breakpod")
    replicas = deployment["spec"]["replicas"]
    pdbs = [
        d
        for d in docs
        if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "bp-breakpod"
    ]
    affinity = deployment["spec"]["template"]["spec"].get("affinity", {})
    if replicas > 1:
        [pdb] = pdbs
        assert pdb["spec"]["minAvailable"] < replicas
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["selector"]["matchLabels"] == labels
        assert "podAntiAffinity" in affinity
    else:
        assert pdbs == [] and "podAntiAffinity" not in affinity


def test_checksum_annotations_roll_the_broker(docs) -> None:
    annotations = find(docs, "Deployment", "bp-breakpod")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert set(CHECKSUMS) <= set(annotations)


def test_changed_tokens_change_the_checksum() -> None:
    def checksum(token: str) -> str:
        docs = documents(render({"auth": {"tokens": {"agent": token}}}))
        annotations = find(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["checksum/auth"])

    assert checksum("agent-token-one") != checksum("agent-token-two")


def test_no_runtime_class_is_forced_by_default() -> None:
    docs = documents(render())
    overlay = yaml.safe_load(find(docs, "ConfigMap")["data"]["overlay.json"])
    assert "runtimeClassName" not in overlay["pod"]


@pytest.mark.parametrize("role", ["agent", "viewer", "admin"])
def test_a_token_shorter_than_the_broker_takes_fails_the_render(role: str) -> None:
    with pytest.raises(Exception, match="tokens"):
        render({"auth": {"tokens": {role: "short"}}})
    render({"auth": {"tokens": {role: "long-enough"}}})  # 8 or more: fine


def test_redis_has_maxmemory_under_its_limit() -> None:
    docs = documents(render())
    [redis_c] = find(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    args = redis_c["args"]
    assert args[args.index("--maxmemory") + 1] == "384mb"
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"
    assert redis_c["resources"]["limits"]["memory"] == "512Mi"  # 384 MB leaves room


def test_broker_tls_serves_https_and_agents_verify_it() -> None:
    docs = scenario(CHART / "ci" / "broker-tls-values.yaml")
    broker = find(docs, "Deployment", "bp-breakpod")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in broker["env"]}
    assert env["BREAKPOD_TLS_CERT_FILE"]["value"].endswith("tls.crt")
    assert broker["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert find(docs, "Certificate", "bp-breakpod-api")["spec"]["secretName"]
    overlay = yaml.safe_load(find(docs, "ConfigMap")["data"]["overlay.json"])
    agent = {e["name"]: e for e in overlay["container"]["env"]}
    assert agent["BREAKPOD_BROKER_URL"]["value"].startswith("https://")
    ca = agent["BREAKPOD_BROKER_CA"]["valueFrom"]["configMapKeyRef"]
    assert ca["name"] == "breakpod-broker-ca"


def test_every_workload_has_a_network_policy_both_ways(docs) -> None:
    """With NetworkPolicies on, no pod of the release is left open: each
    workload's pods are selected by a policy that limits ingress and egress."""
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    if not policies:
        return  # networkPolicy.enabled=false in this scenario
    for doc in (d for d in docs if d["kind"] in WORKLOADS):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        selecting = [
            p for p in policies if p["podSelector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(selecting) == 1, doc["metadata"]["name"]
        assert set(selecting[0]["policyTypes"]) == {"Ingress", "Egress"}, doc["metadata"]["name"]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_every_image_is_pinned_or_named_by_the_user(path: Path) -> None:
    """No image reference the user did not give: the broker's repository is
    theirs, Redis is pinned by digest."""
    given = merged(REQUIRED, scenario_values(path))["image"]["repository"]
    for doc in (d for d in scenario(path) if d["kind"] in WORKLOADS):
        for c in pod_containers(doc):
            assert c["image"].startswith(f"{given}:") or "@sha256:" in c["image"], c["image"]
