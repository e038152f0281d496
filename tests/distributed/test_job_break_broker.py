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
from tests.distributed.test_job_pause import debug_env, parameters
from tests.distributed.torchrun import Job, free_ports, pdb_session

PORT = 29474


def cli(broker, token: str, *args: str, flag: str = "--token") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "breakpod._cli.main", *args, "--broker", broker.url, flag, token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def ranks_registered(broker, job: str) -> list[int] | None:
    listing = json.loads(cli(broker, VIEWER, "sessions", "--job", job, "--json").stdout)
    ranks = sorted(s["rank"] for s in listing if s["state"] != "lost")
    return ranks if ranks == [0, 1, 2, 3] else None


@pytest.mark.slow  # about 60 s on two loaded cores
@pytest.mark.timeout(420)
@pytest.mark.parametrize("late", [False, True], ids=["in-time", "a-rank-hears-late"])
def test_a_job_wide_break_parks_every_rank_at_one_step_and_one_continue_resumes_all(
    broker, tmp_path: Path, late: bool
):
    """With ``late``, rank 2 hears of the break only after it passed the agreed step (then
    waits in a collective behind its parked peers): it moves the break, every rank
    parks at the new step."""
    port = PORT + int(late)
    name = f"job-{port}"
    base = free_ports(4)
    stop = tmp_path / "stop"  # the job runs until told: a slow start cannot outrun the break
    env = debug_env(base, STEPS="100000", STEP_SLEEP="0.1", STOP_FILE=str(stop))
    env.update(BREAKPOD_BROKER_URL=broker.url, BREAKPOD_AGENT_TOKEN=AGENT)
    if late:
        env["LATE_RANK"] = "2"
    job = Job(tmp_path, 4, port, **env)

    def stuck(what: str) -> AssertionError:
        listing = cli(broker, VIEWER, "sessions", "--json").stdout
        return AssertionError(f"{what}\nsessions: {listing}\njob stderr:\n{job.stderr}")

    try:
        try:
            wait_until(lambda: ranks_registered(broker, name), timeout=180)
        except AssertionError:
            raise stuck("not every rank registered") from None
        missing = cli(broker, ADMIN, "attach", name, "--rank", "7", flag="--broker-token")
        assert missing.returncode == 2
        assert f"job '{name}' has no rank 7; its ranks: 0, 1, 2, 3" in missing.stderr
        sent = cli(broker, ADMIN, "send", name, "break")
        assert sent.returncode == 0 and sent.stdout.count("queued break") == 4, sent
        pattern = r"\[rank (\d)\] job-wide break at step (\d+):"
        moved = (
            r"\[rank 2\] this rank passed step \d+ before it heard of the job-wide break; "
            r"the break moves to step (\d+)"
        )

        def all_parked() -> dict[str, str] | None:
            parked = dict(re.findall(pattern, job.stderr))  # each rank's last park
            target = re.findall(moved, job.stderr)[-1:] if late else list(set(parked.values()))
            wanted = len(parked) == 4 and len(target) == 1
            return parked if wanted and set(parked.values()) == set(target) else None

        try:
            parked = wait_until(all_parked, timeout=90)
        except AssertionError:
            raise stuck("not every rank parked at one step") from None
        at = int(parked["3"])
        dialogue = pdb_session(base + 3, "p step", "c")
        assert f"\n{at - 1}\n" in dialogue  # the loop's step variable (0-based)
        stop.touch()
        assert job.wait(timeout=150) == 0, job.stderr
    finally:
        job.kill()
    found = parameters(job.stderr)
    assert len(found) == 4 and len(set(found.values())) == 1, job.stderr
    # a rank parked at a break that moved on says so (it read "resume command": none was sent)
    assert "resume command" not in job.stderr, job.stderr
