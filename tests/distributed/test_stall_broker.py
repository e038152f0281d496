"""A stalled torchrun job reported through the broker: one job-wide stall event (with
rank 0's flight recorder), the ranks grouped under the job in ``breakpod sessions``,
``breakpod stacks JOB`` and ``breakpod flight JOB`` from every rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokerkit import ADMIN, AGENT, VIEWER, wait_until
from tests.distributed.torchrun import Job

PORT = 29166
JOB = f"job-{PORT}"


def cli(broker, token: str, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "breakpod._cli.main",
        *args,
        "--broker",
        broker.url,
        "--token",
        token,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout


def job_stall_event(broker):
    with broker.client(VIEWER) as c:
        events = c.get("/v1/events", params={"kind": "stall", "limit": 100}).json()["events"]
    return next((e for e in events if e["fields"].get("scope") == "job"), None)


@pytest.mark.timeout(150)
def test_the_broker_gets_one_job_stall_event_naming_the_culprit(broker, tmp_path: Path):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT, "STALL_RANK": "2"}
    env["WATCH"] = "1"
    job = Job(tmp_path, 3, PORT, BREAKPOD_STALL_AFTER="3", **env)
    try:
        job.wait_for(r"rank 2 stalls now", timeout=60)
        match, _ = job.wait_for(r"^culprit: (.*)$", timeout=13)
        assert match.group(1).startswith("rank 2 (")
        event = wait_until(lambda: job_stall_event(broker), timeout=20)
        assert event["fields"]["culprits"] == [2]
        assert sorted(r["rank"] for r in event["fields"]["ranks"]) == [0, 1, 2]
        assert "fetch_batch" in event["fields"]["culprit_stacks"]["2"]

        until_listed(broker, _all_stalled)
        # every rank's REASON names the culprit the job waits for, and where it is
        listing = until_listed(broker, _all_blamed)
        assert "culprit rank 2 at" in listing and "fetch_batch" in listing

        stacks = cli(broker, ADMIN, "stacks", JOB)
        blocks = stacks.split("=== ")[1:]
        assert [b.split()[:2] for b in blocks] == [["rank", "0"], ["rank", "1"], ["rank", "2"]]
        assert "fetch_batch" in blocks[2] and "fetch_batch" not in blocks[0]

        assert event["fields"]["flight"]["steps"] == [0, 4]  # rank 0's last five steps
        flight = cli(broker, ADMIN, "flight", JOB)  # asked of ranks stuck in C and in gloo
        blocks = flight.split("=== ")[1:]
        assert [b.split()[:2] for b in blocks] == [["rank", "0"], ["rank", "1"], ["rank", "2"]]
        for block in blocks:
            assert "flight recorder: steps 0-4 (5 kept)" in block, flight
            assert "every watched tensor stayed finite and in range" in block, flight
    finally:
        job.kill()


def until_listed(broker, wanted) -> str:
    """The job's listing once ``wanted`` takes it (each look runs the CLI; 30 s, as other
    torchrun jobs load the machine); failing, the last listing read."""
    seen = [""]

    def look() -> str | None:
        seen[0] = cli(broker, VIEWER, "sessions", "--job", JOB)
        return wanted(seen[0])

    try:
        return str(wait_until(look, timeout=30))
    except AssertionError as e:
        raise AssertionError(f"{e}; the last listing:\n{seen[0]}") from None


def _all_blamed(listing: str) -> str | None:
    return listing if listing.count("culprit rank 2 at") >= 3 else None


def _all_stalled(listing: str) -> str | None:
    # the job's summary line, not a count of " stalled": the STATE column and the summary
    # together say it four times while one rank still reads running
    every = f"job {JOB}: rank 0 stalled, rank 1 stalled, rank 2 stalled"
    return listing if every in listing else None


@pytest.mark.slow  # about 40 s
@pytest.mark.timeout(180)
def test_a_rank_that_breakpod_ends_at_the_timeout_reads_failed_not_stalled(broker, tmp_path):
    """Debug mode ends a rank whose collective passed the process group's timeout with
    ``os._exit(1)``, which skips the exit handler that reports how it ended: the rank read
    ``stalled``, then ``lost``. It reads ``failed`` (exit 1), the state of a non-zero exit."""
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    env.update(ENABLE_REMOTE_DEBUG="1", PG_TIMEOUT="10", STALL_RANK="1", STALL_AT="3")
    job = Job(tmp_path, 2, PORT + 2, STEPS="8", STEP_SLEEP="0.1", **env)
    try:
        job.wait_for(r"rank 1 stalls now", timeout=60)
        assert job.wait(timeout=90) != 0
        assert "exiting with status 1, as the process group's timeout would have" in job.stderr
        listing = wait_until(lambda: _finished(broker, f"job-{PORT + 2}"), timeout=20)
    finally:
        job.kill()
    assert re.search(r" 0/2 +failed .* exit 1 ", listing), listing
    with broker.client(VIEWER) as c:
        ended = c.get("/v1/events", params={"kind": "finished", "limit": 100}).json()["events"]
    assert any(e["fields"].get("exit") == 1 for e in ended), ended


def _finished(broker, job: str) -> str | None:
    listing = cli(broker, VIEWER, "sessions", "--job", job)
    return listing if "rank 0 failed" in listing else None
