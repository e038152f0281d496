"""End to end on a real Docker engine: ``breakpod stacks container:ID`` and
``compose:SERVICE`` read a Python process in a container through ``docker exec``.

The container runs the local base image (scripts/base-images.sh) with no breakpod in
it; this machine's py-spy binary is mounted in, and the container gets SYS_PTRACE, as
a training image with py-spy would run. Without either, ``--image`` runs the probe in a
container of a debug image (the base image with py-spy) that joins its PID namespace.
Run by ``make e2e-docker``; deselected from ``make test``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

IMAGE = "breakpod-python:local"
SPY = Path(sys.executable).with_name("py-spy")
JOB = (
    "import time\ndef wait_for_data():\n    time.sleep(600)\n"
    "print('up', flush=True)\nwait_for_data()\n"
)
SERVICE = f"stacks-e2e-{os.getpid()}"
SPY_IMAGE = "breakpod-stacks-spy:local"


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=True
    )
    return done.stdout.strip()


@pytest.fixture
def container() -> Iterator[str]:
    if not SPY.exists():
        pytest.skip("py-spy is not installed (requirements-dev.txt)")
    cid = docker(
        *("run", "-d", "--rm", "--cap-add=SYS_PTRACE", "--network=none"),
        *("--label", f"com.docker.compose.service={SERVICE}"),
        *("-v", f"{SPY.resolve()}:/usr/local/bin/py-spy:ro", IMAGE, "python3", "-c", JOB),
    )
    try:
        deadline = time.monotonic() + 60
        while "up" not in docker("logs", cid):
            assert time.monotonic() < deadline, docker("logs", cid)
            time.sleep(0.2)
        yield cid
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)


def stacks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", "stacks", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_a_container_is_read_through_docker_exec(container: str) -> None:
    done = stacks(f"container:{container}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "culprit: none found (a single process: nothing to compare it with)"
    where = f"pid 1 in container:{container[:12]}"
    assert lines[2] == f"{where}: in user code, at <string>:3 in wait_for_data"


@pytest.fixture(scope="module")
def spy_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A debug image: the base image with py-spy in it (this machine's binary)."""
    if not SPY.exists():
        pytest.skip("py-spy is not installed (requirements-dev.txt)")
    context = tmp_path_factory.mktemp("spy-image")
    shutil.copy(SPY.resolve(), context / "py-spy")
    (context / "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY py-spy /usr/local/bin/py-spy\n")
    docker("build", "-q", "-t", SPY_IMAGE, str(context), timeout=300)
    return SPY_IMAGE


def test_a_debug_container_reads_an_image_without_py_spy(spy_image: str) -> None:
    """The job's image has neither py-spy nor SYS_PTRACE: with --image, a container of
    the debug image joins its PID namespace with SYS_PTRACE and reads it."""
    cid = docker("run", "-d", "--rm", "--network=none", IMAGE, "python3", "-c", JOB)
    try:
        deadline = time.monotonic() + 60
        while "up" not in docker("logs", cid):
            assert time.monotonic() < deadline, docker("logs", cid)
            time.sleep(0.2)
        done = stacks(f"container:{cid}", "--image", spy_image)
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    where = f"pid 1 in container:{cid[:12]}"
    assert done.stdout.splitlines()[2] == f"{where}: in user code, at <string>:3 in wait_for_data"


def test_an_image_without_py_spy_is_one_line() -> None:
    cid = docker("run", "-d", "--rm", "--network=none", IMAGE, "sleep", "600")
    try:
        done = stacks(f"container:{cid}")
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout.splitlines()[2] == (
        f"pid 1 in container:{cid[:12]}: stacks not read: no py-spy in "
        f"container:{cid[:12]}'s image: pass --image IMAGE (python3 and py-spy)"
    )


def test_a_compose_service_is_found_by_its_label(container: str) -> None:
    doc = json.loads(stacks(f"compose:{SERVICE}", "--json").stdout)
    (process,) = doc["processes"]
    assert (process["pid"], process["host"]) == (1, f"container:{container[:12]}")
    assert process["frame"] == "<string>:3 in wait_for_data"
