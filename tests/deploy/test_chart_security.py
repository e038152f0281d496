"""What the chart does for security by default: an authenticated Redis that
only the broker reaches, NetworkPolicies, no Kubernetes API access.

The Redis test runs the rendered redis-server arguments and probe on a real
redis-server and connects with the broker's rendered URL through redis-py,
after Kubernetes' $(VAR) expansion."""

from __future__ import annotations

import base64
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("helm_python", reason="pip install -r requirements-dev.txt")
redis = pytest.importorskip("redis", reason="pip install -e broker")

from breakpod_broker.redis_server import find_binary, free_port  # noqa: E402
from tests.deploy.conftest import documents, find, render  # noqa: E402

REDIS_HOST = "bp-breakpod-redis:6379"


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of args and env values (defined names only)."""
    return re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: env.get(m[1], m[0]), value)


def secrets_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}


def resolved_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's env as the kubelet builds it: Secret refs read, $(VAR) expanded."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def containers(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = find(docs, kind)["spec"]["template"]["spec"]["containers"]
    return found


@pytest.fixture
def docs() -> list[dict[str, Any]]:
    """One default render (each render generates a new Redis password)."""
    return documents(render())


@pytest.fixture
def rendered_redis(
    docs: list[dict[str, Any]], tmp_path: Path
) -> Iterator[tuple[int, dict[str, str], dict[str, Any]]]:
    """The chart's redis-server command line, run for real on a free loopback port."""
    redis_c = containers(docs, "StatefulSet")[0]
    env = resolved_env(redis_c, secrets_of(docs))
    config = write_auth_config(docs, tmp_path)
    args = [expand(a, env) for a in redis_c["args"]]
    assert args[0] == "redis-server"
    port = free_port()
    args = [find_binary()] + [str(tmp_path) if a == "/data" else a for a in args[1:]]
    args = [str(config) if a == "/config/auth.conf" else a for a in args]
    args += ["--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc)
        yield port, env, redis_c
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("redis-server did not start with the rendered arguments")


def init_container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    pod = find(docs, "StatefulSet")["spec"]["template"]["spec"]
    [init] = [c for c in pod["initContainers"] if c["name"] == name]
    return dict(init)


def write_auth_config(docs: list[dict[str, Any]], tmp_path: Path) -> Path:
    """Run the Redis pod's init container command (sh, as in the image) with /config here."""
    init = init_container(docs, "auth-config")
    env = resolved_env(init, secrets_of(docs))
    (tmp_path / "config").mkdir(exist_ok=True)
    command = [c.replace("/config/", f"{tmp_path}/config/") for c in init["command"]]
    subprocess.run(command, env=env, check=True, timeout=10, stdin=subprocess.DEVNULL)
    return tmp_path / "config" / "auth.conf"


def test_redis_requires_a_generated_password(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    password = secrets_of(docs)["bp-breakpod-redis"]["password"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    config = write_auth_config(docs, tmp_path)
    assert config.read_text() == f"requirepass {password}\n"
    assert oct(config.stat().st_mode & 0o777) == "0o600"


def test_broker_url_carries_the_password(
    docs: list[dict[str, Any]], rendered_redis: tuple[int, dict[str, str], Any]
) -> None:
    port, _, _ = rendered_redis
    broker_env = resolved_env(containers(docs, "Deployment")[0], secrets_of(docs))
    url = broker_env["BREAKPOD_REDIS_URL"]
    assert "$(" not in url and REDIS_HOST in url, url
    local = url.replace(REDIS_HOST, f"127.0.0.1:{port}")
    with redis.Redis.from_url(local, socket_timeout=5) as client:
        assert client.ping()
    anonymous = redis.Redis(port=port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.hset("breakpod:tokens", "x", '{"role":"admin"}')
    anonymous.close()


def test_redis_probes_authenticate(
    rendered_redis: tuple[int, dict[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    port, env, redis_c = rendered_redis
    cli = shutil.which("redis-cli") or str(Path(find_binary()).parent / "redis-cli")
    bin_dir = tmp_path / "bin"  # redis-cli as the probe finds it, pointed at our port
    bin_dir.mkdir()
    (bin_dir / "redis-cli").write_text(f'#!/bin/sh\nexec {cli} -p {port} "$@"\n')
    (bin_dir / "redis-cli").chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    for probe in ("livenessProbe", "readinessProbe"):
        command = redis_c[probe]["exec"]["command"]
        ok = subprocess.run(command, env={**env, "PATH": path}, timeout=10)
        assert ok.returncode == 0, probe
        denied = subprocess.run(command, env={"PATH": path}, capture_output=True, timeout=10)
        assert denied.returncode != 0, f"{probe} passes without the password"


def test_redis_existing_secret() -> None:
    values = {"redis": {"existingSecret": "my-redis", "existingSecretKey": "pw"}}
    docs = documents(render(values))
    assert "bp-breakpod-redis" not in secrets_of(docs)
    ref = {"secretKeyRef": {"name": "my-redis", "key": "pw"}}
    init = init_container(docs, "auth-config")
    redis_c = containers(docs, "StatefulSet")[0]
    for name, container in [("init", init), ("broker", containers(docs, "Deployment")[0])]:
        env = {e["name"]: e.get("valueFrom") for e in container["env"]}
        assert env["REDIS_PASSWORD"] == ref, name
    assert {e["name"]: e.get("valueFrom") for e in redis_c["env"]}["REDISCLI_AUTH"] == ref


def test_external_redis_url_is_used_as_given() -> None:
    url = "redis://redis.infra.svc:6379/2"
    docs = documents(render({"redis": {"enabled": False, "url": url}}))
    env = {e["name"]: e.get("value") for e in containers(docs, "Deployment")[0]["env"]}
    assert env["BREAKPOD_REDIS_URL"] == url and "REDIS_PASSWORD" not in env
    assert not [d for d in docs if d["kind"] == "StatefulSet"]


def test_an_external_redis_url_with_a_password_comes_from_a_secret() -> None:
    secret = {"enabled": False, "urlSecret": {"name": "redis-url", "key": "url"}}
    docs = documents(render({"redis": secret}))
    env = {e["name"]: e for e in containers(docs, "Deployment")[0]["env"]}
    ref = {"secretKeyRef": {"name": "redis-url", "key": "url"}}
    assert env["BREAKPOD_REDIS_URL"]["valueFrom"] == ref
    plain = {"enabled": False, "url": "redis://:s3cret@redis.infra.svc:6379/2"}
    with pytest.raises(Exception, match=r"set redis\.urlSecret\.name"):
        render({"redis": plain})


def test_network_policies_by_default(docs: list[dict[str, Any]]) -> None:
    broker = find(docs, "NetworkPolicy", "bp-breakpod")["spec"]
    api, *others = broker["ingress"]
    assert not others  # no webhook port: the webhook has pods of its own
    opted_in = {"matchLabels": {"breakpod.dev/inject": "enabled"}}  # the webhook's label
    assert api["from"] == [{"podSelector": {}}, {"namespaceSelector": opted_in}]
    assert api["ports"] == [{"port": "http", "protocol": "TCP"}]
    redis_policy = find(docs, "NetworkPolicy", "bp-breakpod-redis")["spec"]
    assert redis_policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    (rule,) = redis_policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "broker"
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


def test_network_policies_can_be_turned_off() -> None:
    docs = documents(render({"networkPolicy": {"enabled": False}}))
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_no_kubernetes_api_access(docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}, kinds
    assert find(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    for kind in ("Deployment", "StatefulSet"):
        assert find(docs, kind)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def token_command(notes: str, role_line: str) -> str:
    """The $(...) command NOTES.txt gives on the line containing role_line."""
    line = next(ln for ln in notes.splitlines() if role_line in ln)
    match = re.search(r"\$\((kubectl .*)\)", line)
    assert match, line
    return match[1]


def run_with_secret(command: str, secret_data: dict[str, str]) -> str:
    """Run the command with `kubectl ... -o jsonpath='{.data.KEY}'` answered from secret_data."""
    get, rest = command.split(" | ", 1)
    key = re.fullmatch(r"kubectl -n \S+ get secret \S+ -o jsonpath='\{\.data\.([\w.-]+)\}'", get)
    assert key, get
    encoded = base64.b64encode(secret_data[key[1]].encode()).decode()
    out = subprocess.run(
        ["sh", "-c", f"printf %s {encoded} | {rest}"], capture_output=True, text=True, timeout=10
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("existing", [False, True])
def test_notes_read_the_right_tokens(existing: bool) -> None:
    values = {"auth": {"existingSecret": "mine", "existingSecretKey": "list"}} if existing else {}
    rendered = render(values)
    notes = rendered["breakpod/templates/NOTES.txt"]
    if existing:
        secret = {"list": "admin:a-0000000000, viewer:v-0000000000,agent:g-0000000000"}
        assert "get secret mine " in notes
    else:
        secret = secrets_of(documents(rendered))["bp-breakpod"]
    viewer = run_with_secret(token_command(notes, "export BREAKPOD_BROKER_TOKEN="), secret)
    agent = run_with_secret(token_command(notes, "--from-literal="), secret)
    expected = (
        ("v-0000000000", "g-0000000000")
        if existing
        else (secret["viewer-token"], secret["agent-token"])
    )
    assert (viewer, agent) == expected
