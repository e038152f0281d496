"""The install path a user takes: both wheels built from the repository and
installed by the README's own lines into a fresh venv with no torch (conftest.py;
pip's configured index supplies the broker's dependencies), then `breakpod --help`,
`breakpod doctor` and a headless `breakpoint()` that parks and is continued over
the socket."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.install.conftest import ROOT, clean_env, run

PARK = re.compile(r"waiting .* on 127\.0\.0\.1:(\d+)")
JOB = "x = 41\nbreakpoint()\nprint('finished', x + 1, flush=True)\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheels_install_without_torch_and_the_commands_run(venv: Path) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    assert run(venv / "python", "-c", probe).stdout.strip() == "True"  # torch never pulled in
    where = run(venv / "python", "-c", "import breakpod; print(breakpod.__file__)").stdout
    assert str(ROOT) not in where  # the installed wheel, not this checkout
    assert "attach" in run(venv / "breakpod", "--help", env=clean_env()).stdout
    assert "serve" in run(venv / "breakpod-broker", "--help", env=clean_env()).stdout
    doctor = run(venv / "breakpod", "doctor", env=clean_env())
    assert "nothing blocks attaching" in doctor.stdout and "Traceback" not in doctor.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_headless_breakpoint_parks_and_continues_over_the_socket(venv: Path, tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**clean_env(), "PYTHONBREAKPOINT": "breakpod.set_trace", "BREAKPOD_PORT": "0"}
    err = tmp_path / "job.err"
    with err.open("wb") as log:
        job = subprocess.Popen(
            ["/bin/sh", "-c", 'exec "$@" <&-', "sh", str(venv / "python"), str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    try:
        port = wait_for_park(err, job)
        attached = subprocess.run(
            [str(venv / "breakpod"), "attach", f"127.0.0.1:{port}"],
            input="p x\nc\n",
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert attached.returncode == 0, attached.stderr
        assert "41" in attached.stdout
        assert job.wait(timeout=60) == 0
        assert job.stdout is not None and "finished 42" in job.stdout.read().decode()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def wait_for_park(err: Path, job: subprocess.Popen[bytes], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = PARK.search(err.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        assert job.poll() is None, err.read_text()
        time.sleep(0.05)
    raise AssertionError(f"no park line within {timeout}s:\n{err.read_text()}")
