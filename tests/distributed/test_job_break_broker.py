"""`breakpod send JOB break` through a real broker parks every rank of a 4-rank job at
one step; attaching to one rank and continuing resumes them all (real torchrun, gloo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokerkit import ADMIN, AGENT, VIEWER, wait_until
from tests.distributed.test_job_pause import debug_env, free_ports, parameters, pdb_session
from tests.distributed.torchrun import Job

PORT = 29474
JOB = f"job-{PORT}"


def cli(broker, token: str, *args: str, flag: str = "--token") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "breakpod._cli.main", *args, "--broker", broker.url, flag, token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def ranks_registered(broker) -> list[int] | None:
    listing = json.loads(cli(broker, VIEWER, "sessions", "--job", JOB, "--json").stdout)
    ranks = sorted(s["rank"] for s in listing if s["state"] != "lost")
    return ranks if ranks == [0, 1, 2, 3] else None


@pytest.mark.slow  # about 60 s on two loaded cores
@pytest.mark.timeout(420)
def test_a_job_wide_break_parks_every_rank_at_one_step_and_one_continue_resumes_all(
    broker, tmp_path: Path
):
    base = free_ports(4)
    stop = tmp_path / "stop"  # the job runs until told: a slow start cannot outrun the break
    env = debug_env(base, STEPS="100000", STEP_SLEEP="0.1", STOP_FILE=str(stop))
    env.update(BREAKPOD_BROKER_URL=broker.url, BREAKPOD_AGENT_TOKEN=AGENT)
    job = Job(tmp_path, 4, PORT, **env)
    try:
        try:
            wait_until(lambda: ranks_registered(broker), timeout=180)
        except AssertionError:
            listing = cli(broker, VIEWER, "sessions", "--json").stdout
            raise AssertionError(f"sessions: {listing}\njob stderr:\n{job.stderr}") from None
        missing = cli(broker, ADMIN, "attach", JOB, "--rank", "7", flag="--broker-token")
        assert missing.returncode == 2
        assert f"job '{JOB}' has no rank 7; its ranks: 0, 1, 2, 3" in missing.stderr
        sent = cli(broker, ADMIN, "send", JOB, "break")
        assert sent.returncode == 0 and sent.stdout.count("queued break") == 4, sent
        pattern = r"\[rank (\d)\] job-wide break at step (\d+):"
        try:
            wait_until(lambda: len(re.findall(pattern, job.stderr)) >= 4 or None, timeout=90)
        except AssertionError:
            listing = cli(broker, VIEWER, "sessions", "--job", JOB, "--json").stdout
            raise AssertionError(f"sessions: {listing}\njob stderr:\n{job.stderr}") from None
        parked = dict(re.findall(pattern, job.stderr))
        assert sorted(parked) == ["0", "1", "2", "3"]
        assert len(set(parked.values())) == 1, parked  # one step for every rank
        at = int(parked["3"])
        dialogue = pdb_session(base + 3, "p step", "c")
        assert f"\n{at - 1}\n" in dialogue  # the loop's step variable (0-based)
        stop.touch()
        assert job.wait(timeout=150) == 0, job.stderr
    finally:
        job.kill()
    found = parameters(job.stderr)
    assert len(found) == 4 and len(set(found.values())) == 1, job.stderr
