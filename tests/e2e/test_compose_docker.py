"""End to end on a real Docker engine: the compose stack with the debug overlay.

The example training job hits a NaN and parks; the broker lists it; an
engineer attaches from the host through the 127.0.0.1-published port, looks
at a tensor, continues, and the container exits 0. Run by `make e2e-docker`
(scripts/e2e-docker.sh starts dockerd and builds the local base images);
deselected from `make test`.
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

import pytest

from tests.conftest import PdbClient

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BREAKPOD = str(Path(sys.executable).parent / "breakpod")
PROJECT = "breakpod-e2e"
FILES = ["-f", "compose.yml", "-f", "compose.debug.yml", "-f", "compose.cpu.yml"]
BROKER = "http://127.0.0.1:8765"
AGENT_TOKEN = "e2e-agent-token"  # compose has no default tokens
VIEWER_TOKEN = "e2e-viewer-token"
LISTENER_TOKEN = "e2e-listener-token"
ENV = {
    **os.environ,
    "COMPOSE_PROJECT_NAME": PROJECT,
    "BREAKPOD_TRAIN_BASE_IMAGE": "breakpod-torch:local",
    "BREAKPOD_REDIS_IMAGE": "breakpod-redis:local",
    "BREAKPOD_AGENT_TOKEN": AGENT_TOKEN,
    "BREAKPOD_VIEWER_TOKEN": VIEWER_TOKEN,
    "BREAKPOD_ADMIN_TOKEN": "e2e-admin-token",
    "BREAKPOD_LISTENER_TOKEN": LISTENER_TOKEN,
}
IMAGES = {  # tag compose expects -> (Dockerfile, build args)
    "breakpod-broker:dev": ("docker/broker.Dockerfile", {"PYTHON_IMAGE": "breakpod-python:local"}),
    "breakpod-train:dev": ("docker/debug.Dockerfile", {"BASE_IMAGE": "breakpod-torch:local"}),
}


def run(*cmd: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def compose(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return run("docker-compose", *FILES, *args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    if run("docker", "info", check=False, timeout=30).returncode != 0:
        pytest.skip("no Docker engine (make e2e-docker starts one)")
    for tag, (dockerfile, args) in IMAGES.items():
        build_args = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
        run(
            "docker",
            "build",
            "-q",
            "--network",
            "host",
            "-f",
            dockerfile,
            *build_args,
            "-t",
            tag,
            ".",
            timeout=600,
        )
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


def sessions() -> list[dict[str, object]]:
    out = run(BREAKPOD, "sessions", "--json", "--broker", BROKER, "--broker-token", VIEWER_TOKEN)
    return list(json.loads(out.stdout))


def test_nan_parks_in_the_container_and_an_engineer_attaches_from_the_host(stack):
    wait_for_log("train", r"waiting .* for a debugger on 0\.0\.0\.0:5678")
    parked = [s for s in sessions() if s.get("state") == "parked"]
    assert len(parked) == 1, sessions()

    client = PdbClient(5678)  # the 127.0.0.1 port compose published
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
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sessions()[0].get("state") != "finished":
        time.sleep(1)
    assert sessions()[0].get("state") == "finished"
