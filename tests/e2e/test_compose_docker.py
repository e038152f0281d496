"""End to end on a real Docker engine: the compose stack with the debug overlay.

The example training job hits a NaN and parks; the broker lists it; an
engineer attaches from the host through the 127.0.0.1-published port, looks
at a tensor, continues, and the container exits 0. A second job, stopped
while parked (`compose stop`: SIGTERM through dumb-init), is listed as
`killed` (signal 15 (SIGTERM)). The stack has its own project name and free host
ports, and a second stack runs beside it with its own broker and Redis;
compose builds both images on the local base images. The overlay gives `train`
a TTY, and `breakpoint()` still parks on the socket (ENABLE_REMOTE_DEBUG=1).
Run by `make e2e-docker` (scripts/e2e-docker.sh starts dockerd and builds the
local base images); deselected from `make test`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from breakpod_broker.redis_server import free_port
from tests.conftest import PdbClient
from tests.e2e.compose_cli import compose_command

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BREAKPOD = str(Path(sys.executable).parent / "breakpod")
FILES = ["-f", "compose.yml", "-f", "compose.debug.yml", "-f", "compose.cpu.yml"]
BROKER_PORT, LISTENER_PORT = free_port(), free_port()
BROKER = f"http://127.0.0.1:{BROKER_PORT}"
AGENT_TOKEN = "e2e-agent-token"  # compose has no default tokens
VIEWER_TOKEN = "e2e-viewer-token"
LISTENER_TOKEN = "e2e-listener-token"
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")},
    "COMPOSE_PROJECT_NAME": f"breakpod-e2e-{os.getpid()}",
    "BREAKPOD_BROKER_PUBLISH": str(BROKER_PORT),
    "BREAKPOD_LISTENER_PUBLISH": str(LISTENER_PORT),
    # scripts/base-images.sh builds these; the package index comes through the host
    "BREAKPOD_BROKER_BASE_IMAGE": "breakpod-python:local",
    "BREAKPOD_TRAIN_BASE_IMAGE": "breakpod-torch:local",
    "BREAKPOD_REDIS_IMAGE": "breakpod-redis:local",
    "BREAKPOD_BUILD_NETWORK": "host",
    "BREAKPOD_AGENT_TOKEN": AGENT_TOKEN,
    "BREAKPOD_VIEWER_TOKEN": VIEWER_TOKEN,
    "BREAKPOD_ADMIN_TOKEN": "e2e-admin-token",
    "BREAKPOD_LISTENER_TOKEN": LISTENER_TOKEN,
}


def run(
    *cmd: str, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env or ENV,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def compose(
    *args: str, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    assert command is not None
    return run(*command, *FILES, *args, timeout=timeout, check=check, env=env)


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    if compose_command() is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    if run("docker", "info", check=False, timeout=30).returncode != 0:
        pytest.skip("no Docker engine (make e2e-docker starts one)")
    compose("build", timeout=600)  # the broker's base image through compose too
    compose("down", "-v", "--remove-orphans", check=False)
    compose("up", "-d", "--no-build", timeout=300)
    try:
        yield
    finally:
        logs = compose("logs", "--no-color", check=False).stdout
        compose("down", "-v", "--remove-orphans", check=False, timeout=120)
        print(logs[-4000:])


def wait_for_log(service: str, pattern: str, timeout: float = 240) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = compose("logs", "--no-color", service, check=False).stdout
        match = re.search(pattern, logs)
        if match:
            return match
        time.sleep(1)
    raise AssertionError(f"{pattern!r} not in {service} logs:\n{logs[-3000:]}")


def sessions(broker: str = BROKER) -> list[dict[str, Any]]:
    out = run(BREAKPOD, "sessions", "--json", "--broker", broker, "--broker-token", VIEWER_TOKEN)
    return list(json.loads(out.stdout))


def wait_for_session(condition: Any, timeout: float = 240) -> dict[str, Any]:
    """The first listed session that meets ``condition``, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in sessions() if condition(s)]
        if found:
            return found[0]
        time.sleep(1)
    raise AssertionError(f"no such session within {timeout}s: {sessions()}")


def test_nan_parks_in_the_container_and_an_engineer_attaches_from_the_host(stack):
    wait_for_log("train", r"waiting .* for a debugger on 0\.0\.0\.0:5678")
    parked = [s for s in sessions() if s.get("state") == "parked"]
    assert len(parked) == 1, sessions()

    client = PdbClient(LISTENER_PORT)  # the 127.0.0.1 port compose published
    try:
        assert "token required" in client.read_until("\n")
        client.send(LISTENER_TOKEN)  # the pdb listener's own token
        assert "breakpoint() at" in client.read_until()
        assert "nan" in client.command("p loss")
        summary = client.command("tstat x")
        assert "[32,16]" in summary.replace(" ", "") and "nan=1" in summary, summary
        client.send("c")
        client.read_all()
    finally:
        client.close()

    container = compose("ps", "-q", "train").stdout.strip()
    assert run("docker", "wait", container, timeout=120).stdout.strip() == "0"
    wait_for_log("train", r"training finished")
    finished = wait_for_session(lambda s: s["id"] == parked[0]["id"] and s["state"] == "finished")
    assert finished["reason"] == "exit 0"


def test_a_container_stopped_while_parked_is_killed_by_signal_15(stack):
    before = {s["id"] for s in sessions()}
    compose("up", "-d", "--no-build", "--no-deps", "--force-recreate", "train")
    parked = wait_for_session(lambda s: s["id"] not in before and s["state"] == "parked")
    container = compose("ps", "-q", "train").stdout.strip()
    compose("stop", "-t", "30", "train")  # SIGTERM to dumb-init, forwarded to python

    exit_code = run("docker", "inspect", "-f", "{{.State.ExitCode}}", container).stdout
    assert exit_code.strip() == "143"  # died of SIGTERM, as without breakpod
    killed = wait_for_session(lambda s: s["id"] == parked["id"] and s["state"] == "killed")
    assert killed["reason"] == "signal 15 (SIGTERM)"


def test_a_second_stack_runs_beside_the_first(stack):
    """Another project name and other host ports: its own broker, Redis and sessions."""
    second_broker = free_port()
    second = {**ENV, "COMPOSE_PROJECT_NAME": f"{ENV['COMPOSE_PROJECT_NAME']}-b"}
    second["BREAKPOD_BROKER_PUBLISH"] = str(second_broker)
    second["BREAKPOD_LISTENER_PUBLISH"] = str(free_port())
    try:
        compose("up", "-d", "--no-build", "broker", env=second)  # its Redis comes with it
        url = f"http://127.0.0.1:{second_broker}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not answers(url):
            time.sleep(1)
        assert answers(url), compose("logs", "--no-color", env=second, check=False).stdout
        assert sessions(url) == [], "the second broker lists its own (no) sessions"
        assert sessions(), "the first stack still answers on its own port"
    finally:
        compose("down", "-v", "--remove-orphans", env=second, check=False, timeout=120)


def answers(broker: str) -> bool:
    listed = run(
        BREAKPOD, "sessions", "--broker", broker, "--broker-token", VIEWER_TOKEN, check=False
    )
    return listed.returncode == 0
