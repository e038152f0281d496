"""A stalled torchrun job names its culprit rank (real torchrun, gloo, CPU)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.torchrun import Job

STALL_AFTER = 3.0
CULPRIT = r"^breakpod: culprit: (.*)$"


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def start(nproc: int, port: int, **env: str) -> Job:
        jobs.append(Job(tmp_path, nproc, port, BREAKPOD_STALL_AFTER=str(STALL_AFTER), **env))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill()


def culprit_lines(stderr: str) -> list[str]:
    return re.findall(r"^culprit: .*$", stderr, re.MULTILINE)


@pytest.mark.slow  # about 25 s: the stall lasts 10 s, then 75 steps after it
@pytest.mark.timeout(120)
def test_a_rank_blocked_in_data_loading_is_the_culprit_and_recovery_is_said_once(torchrun):
    job = torchrun(3, 29160, STALL_RANK="2", STALL_SECONDS="10", STEPS="80", STEP_SLEEP="0.05")
    _, stalled = job.wait_for(r"rank 2 stalls now", timeout=60)
    match, seen = job.wait_for(r"^culprit: (.*)$", timeout=STALL_AFTER + 10)
    assert seen - stalled < STALL_AFTER + 10
    assert match.group(1).startswith("rank 2 (") and "fetch_batch" in match.group(1)
    report = job.stderr.split("] stall: the job")[1]
    assert re.search(r"stacks of rank 2:\n(.*\n)*.*in fetch_batch", report)
    assert re.search(r"^rank 0: step \d+, in collective #\d+", report, re.MULTILINE)
    assert job.wait(timeout=60) == 0, job.stderr
    assert len(culprit_lines(job.stderr)) == 1  # one report for the whole job, not per tick
    assert job.stderr.count("stall over: every rank is stepping again") == 1


@pytest.mark.timeout(120)
def test_a_rank_spinning_in_python_with_the_gil_is_the_culprit(torchrun):
    job = torchrun(4, 29162, STALL_RANK="1", STALL_KIND="spin", COLLECTIVE="all_reduce")
    job.wait_for(r"rank 1 stalls now", timeout=60)
    match, _ = job.wait_for(r"^culprit: (.*)$", timeout=STALL_AFTER + 10)
    assert match.group(1).startswith("rank 1 (") and "spin_forever" in match.group(1)
    assert culprit_lines(job.stderr) == [match.group(0)]


@pytest.mark.timeout(150)
def test_a_healthy_job_reports_nothing(torchrun):
    job = torchrun(4, 29164, STEPS="200")
    assert job.wait(timeout=120) == 0, job.stderr
    assert "breakpod:" not in job.stderr, job.stderr
