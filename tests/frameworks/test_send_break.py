"""`breakpod send JOB break` through a real broker parks a loop that never calls
breakpod.step() (debug mode, no breakpod line), at its optimizer step; `c` resumes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.brokerkit import ADMIN, AGENT, VIEWER, wait_until
from tests.frameworks.jobs import ROOT, script


def cli(broker: Any, *args: str, token: str = ADMIN) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "breakpod._cli.main", *args, "--broker", broker.url]
    cmd += ["--token", token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def registered(broker: Any, job: str) -> bool:
    listing = json.loads(cli(broker, "sessions", "--job", job, "--json", token=VIEWER).stdout)
    return any(s["state"] != "lost" for s in listing)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_break_sent_to_the_job_parks_at_the_next_optimizer_step(
    broker: Any, spawn: Any, pdb_client: Any, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    env = {
        "PYTHONPATH": ROOT,
        "ENABLE_REMOTE_DEBUG": "1",
        "BREAKPOD_BROKER_URL": broker.url,
        "BREAKPOD_AGENT_TOKEN": AGENT,
        "BREAKPOD_JOB": "zero-code-job",
        "BREAKPOD_HOLD_SECONDS": "120",
        "STEPS": "100000",
        "STEP_SLEEP": "0.05",
        "STOP_FILE": str(stop),
    }
    child = spawn(script("plain"), env=env, stdin="closed")
    wait_until(lambda: registered(broker, "zero-code-job"), timeout=90)
    sent = cli(broker, "send", "zero-code-job", "break")
    assert sent.returncode == 0 and "queued break" in sent.stdout, sent
    client = pdb_client(child.park_port(timeout=60))
    banner = client.read_until()
    assert "-> opt.step()" in banner, banner
    assert client.command("p type(model).__name__").strip() == "'Net'"
    stop.write_text("")
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 0, child.stderr
