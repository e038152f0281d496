"""The README's wheel install leaves a working broker and CLI: in the fresh venv its
own lines built (conftest.py), ``breakpod-broker serve --dev`` starts, a headless
``breakpoint()`` registers with it and parks, and ``breakpod attach SESSION`` reaches
it through the broker with the exports ``serve --dev`` printed."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.install.conftest import clean_env, readme_wheel_lines, run

EXPORT = re.compile(r"for the (job|CLI):\s+export (.*)$", re.MULTILINE)
PARK = re.compile(r"waiting .* on 127\.0\.0\.1:(\d+)")
JOB = "x = 41\nbreakpoint()\nprint('finished', x + 1, flush=True)\n"
T = TypeVar("T")


def test_the_readme_installs_both_wheels_and_the_debugpy_extra() -> None:
    lines = readme_wheel_lines()
    assert "breakpod_broker-" in lines and "[debugpy]" in lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_install_serves_a_broker_that_a_parked_job_and_attach_reach(
    venv: Path, tmp_path: Path
) -> None:
    assert "debugpy" in run(venv / "python", "-m", "pip", "list").stdout  # the extra came
    err = tmp_path / "broker.err"
    argv = [venv / "breakpod-broker", "serve", "--dev", "--port", str(free_port())]
    with err.open("wb") as log:
        broker = subprocess.Popen(
            [*map(str, argv), "--data-dir", str(tmp_path / "data")],
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        exports = wait_for_exports(err, broker)
        job = start_job(venv, tmp_path, exports["job"])
        cli = clean_env(**exports["CLI"])
        session = wait_for(lambda: parked_session(venv, cli), job, "the parked session")
        listed = run(venv / "breakpod", "sessions", env=cli).stdout
        assert session in listed and "parked" in listed
        attached = subprocess.run(
            [str(venv / "breakpod"), "attach", session],
            input="p x\nc\n",
            capture_output=True,
            text=True,
            timeout=60,
            env=cli,
        )
        assert attached.returncode == 0, attached.stderr
        assert "41" in attached.stdout
        assert job.wait(timeout=60) == 0
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=60)


def start_job(venv: Path, tmp_path: Path, exports: dict[str, str]) -> subprocess.Popen[bytes]:
    """A headless job with the job's exports, parked on breakpoint()."""
    script, err = tmp_path / "job.py", tmp_path / "job.err"
    script.write_text(JOB)
    env = clean_env(PYTHONBREAKPOINT="breakpod.set_trace", BREAKPOD_PORT="0", **exports)
    with err.open("wb") as log:
        job = subprocess.Popen(
            [str(venv / "python"), str(script)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    wait_for(lambda: PARK.search(err.read_text()), job, "a park line")
    return job


def parked_session(venv: Path, cli: dict[str, str]) -> str | None:
    listing = subprocess.run(
        [str(venv / "breakpod"), "sessions", "--json", "--state", "parked"],
        capture_output=True,
        text=True,
        timeout=30,
        env=cli,
    )
    found = json.loads(listing.stdout or "[]") if listing.returncode == 0 else []
    return str(found[0]["id"]) if found else None


def wait_for_exports(err: Path, broker: subprocess.Popen[bytes]) -> dict[str, dict[str, str]]:
    """The job's and the CLI's variables from what ``serve --dev`` prints, once the
    broker answers."""

    def printed() -> dict[str, dict[str, str]] | None:
        said = EXPORT.findall(err.read_text(errors="replace"))
        found = {who: dict(pair.split("=", 1) for pair in pairs.split()) for who, pairs in said}
        return found if len(found) == 2 else None

    exports = wait_for(printed, broker, "the exports of serve --dev")
    url = exports["CLI"]["BREAKPOD_BROKER_URL"]
    wait_for(lambda: healthy(url), broker, f"{url}/healthz")
    return exports


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1):
            return True
    except OSError:
        return False


def wait_for(
    probe: Callable[[], T | None], proc: subprocess.Popen[bytes], what: str, timeout: float = 60
) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
