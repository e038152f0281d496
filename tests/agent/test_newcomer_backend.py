"""``BREAKPOD_BACKEND=debugpy`` and ``breakpod run --backend debugpy`` take effect for
``breakpoint()``: a headless breakpoint starts the debugpy listener and waits for a DAP
client there (a plain remote pdb parked before, unless the code had called
``init_remote_debugger(backend="debugpy")``). A real DAP client attaches and continues."""

from __future__ import annotations

import re

import pytest

from tests.dap import continue_parked

JOB = """
x = 41
breakpoint()
print("finished", x + 1, flush=True)
"""
DAP_PARK = re.compile(r"waiting up to 30s for a DAP client on 127\.0\.0\.1:(\d+)")


def continue_over_dap(child) -> None:
    port = int(child.wait_for(DAP_PARK, timeout=30).group(1))
    continue_parked(port)
    assert child.wait(timeout=30) == 0, child.stderr
    assert "finished 42" in child.stdout()


@pytest.mark.timeout(90)
def test_breakpod_backend_debugpy_parks_breakpoint_on_a_dap_listener(spawn) -> None:
    child = spawn(JOB, env={"BREAKPOD_BACKEND": "debugpy", "BREAKPOD_HOLD_SECONDS": "30"})
    continue_over_dap(child)
    assert "remote pdb" not in child.stderr and "breakpod attach 127" not in child.stderr


@pytest.mark.timeout(90)
def test_breakpod_run_backend_debugpy_parks_breakpoint_on_a_dap_listener(spawn, tmp_path) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run = f"""
import sys
from breakpod._cli.main import main
sys.exit(main(["run", "--backend", "debugpy", "--hold", "30", "--", sys.executable, {str(job)!r}]))
"""
    child = spawn(run, breakpod=False)
    continue_over_dap(child)


def test_the_pdb_backend_still_parks_on_the_remote_pdb(spawn) -> None:
    child = spawn(JOB, env={"BREAKPOD_BACKEND": "pdb", "BREAKPOD_HOLD_SECONDS": "1"})
    assert child.wait(timeout=30) == 0
    assert "for a debugger on 127.0.0.1" in child.stderr and "DAP" not in child.stderr


def test_under_the_token_policy_breakpoint_starts_no_debugpy_listener(spawn) -> None:
    """BREAKPOD_REQUIRE_TOKEN=1: debugpy cannot check a token, so no listener starts;
    one line says so and the job goes on (never an open DAP port)."""
    env = {
        "BREAKPOD_BACKEND": "debugpy",
        "BREAKPOD_REQUIRE_TOKEN": "1",
        "BREAKPOD_LISTENER_TOKEN": "0123456789abcdef0123",
        "BREAKPOD_HOLD_SECONDS": "30",
    }
    child = spawn(JOB, env=env)
    assert child.wait(timeout=30) == 0, child.stderr
    assert "debugpy cannot check one" in child.stderr and "listening" not in child.stderr
    assert "finished 42" in child.stdout()
