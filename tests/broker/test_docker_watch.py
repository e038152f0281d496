"""Why a container's process died, from the real Docker engine's events: a container
killed by its memory limit reads OOMKilled, an exit status failed, docker kill a
signal. Behind the ``docker`` marker (make e2e-docker runs them; make test stays
engine-free). The containers run busybox, imported from Debian's static binary
(no registry is reachable); the sessions are registered by the test with the
container's id, as an agent inside it reports it."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import time

import pytest

from tests.brokerkit import VIEWER, register, wait_until

pytestmark = pytest.mark.docker
IMAGE = "breakpod-test-busybox"
BUSYBOX = shutil.which("busybox")


def docker(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def image() -> str:
    engine = shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True)
    if not engine or engine.returncode != 0:
        pytest.skip("no Docker engine answers (scripts/e2e-docker.sh starts one)")
    if BUSYBOX is None:
        pytest.skip("no busybox binary: apt-get install -y busybox-static")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(BUSYBOX, "bin/busybox")
        for name in ("sh", "tail", "sleep"):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    subprocess.run(
        ["docker", "import", "-", IMAGE], input=archive.getvalue(), check=True, capture_output=True
    )
    return IMAGE


def session(broker, session_id):
    with broker.client(VIEWER) as c:
        return c.get(f"/v1/sessions/{session_id}").json()


def start(image: str, name: str, script: str, *flags: str) -> str:
    docker("rm", "-f", name)
    return docker("run", "-d", "--name", name, *flags, image, "sh", "-c", script)


@pytest.mark.timeout(120)
def test_a_container_killed_by_its_memory_limit_reads_oomkilled(start_broker, image):
    broker = start_broker(BREAKPOD_DOCKER_WATCH="on")
    names = ["bp-oom", "bp-exit", "bp-kill"]
    try:
        scripts = {  # each dies a few seconds after its session registers
            "oom": ("sleep 5; tail /dev/zero", "--memory", "16m", "--memory-swap", "16m"),
            "exit": ("sleep 5; exit 3",),
            "kill": ("sleep 60",),
        }
        for (sid, (script, *flags)), name in zip(scripts.items(), names, strict=True):
            cid = start(image, name, script, *flags)
            register(broker, sid, runtime="docker", container=cid[:12], host=cid[:12])
        started = time.monotonic()
        docker("kill", names[2])
        ended = {
            sid: wait_until(
                lambda sid=sid: session(broker, sid)["state"] in ("killed", "failed"), 30
            )
            and session(broker, sid)
            for sid in ("oom", "exit", "kill")
        }
        print(f"\nthree containers' deaths recorded in {time.monotonic() - started:.1f} s")
    finally:
        docker("rm", "-f", *names)
    assert (ended["oom"]["state"], ended["oom"]["reason"]) == ("killed", "OOMKilled (exit 137)")
    assert (ended["exit"]["state"], ended["exit"]["reason"]) == ("failed", "exit 3")
    assert (ended["kill"]["state"], ended["kill"]["reason"]) == (
        "killed",
        "signal 9 (SIGKILL) (exit 137)",
    )
    with broker.client(VIEWER) as c:
        events = c.get("/v1/events", params={"session": "oom", "kind": "killed"}).json()["events"]
    assert events[0]["fields"]["source"] == "docker"


def test_on_without_an_engine_refuses_to_start_and_auto_says_one_line(start_broker, tmp_path):
    away = f"unix://{tmp_path}/no.sock"
    with pytest.raises(AssertionError, match="no Docker engine answers"):
        start_broker(BREAKPOD_DOCKER_WATCH="on", DOCKER_HOST=away)
    broker = start_broker(BREAKPOD_DOCKER_WATCH="auto", DOCKER_HOST=away)
    assert register(broker, "s1")["state"] == "running"
