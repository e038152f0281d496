"""One rank parks, the whole job waits past its own collective timeout, then resumes in
step (real torchrun, gloo, CPU, debug mode); a real hang still fails fast."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.torchrun import Job, free_ports, pdb_session

PG_TIMEOUT = 15.0


def debug_env(base: int, **env: str) -> dict[str, str]:
    return {
        "ENABLE_REMOTE_DEBUG": "1",
        "PYTHONBREAKPOINT": "breakpod.set_trace",
        "BREAKPOD_PORT": str(base),
        "BREAKPOD_HOLD_SECONDS": "120",
        "PG_TIMEOUT": str(PG_TIMEOUT),
        **env,
    }


def parameters(stderr: str) -> dict[str, str]:
    # ranks share one stderr file: a line may run into another's
    return dict(re.findall(r"rank (\d+) done, parameters (-?[0-9.]+(?:e[-+]?\d+)?)", stderr))


@pytest.mark.slow  # about 60 s: a 35 s park past a 15 s timeout
@pytest.mark.timeout(240)
def test_a_park_longer_than_the_process_group_timeout_pauses_the_job_then_it_finishes(
    tmp_path: Path,
):
    base = free_ports(2)
    env = debug_env(base, PARK_RANK="1", PARK_AT="3", STEPS="8", STEP_SLEEP="0.1")
    job = Job(tmp_path, 2, 29470, **env)
    try:
        job.wait_for(r"\[rank 1\] breakpoint\(\) at .*waiting up to", timeout=90)
        said, _ = job.wait_for(r"^breakpod: \[rank 0\] rank 1 parked at (.*)$", timeout=5)
        assert re.match(r"stall_job\.py:\d+ in main \(breakpoint\); this rank waits", said[1])
        time.sleep(35)  # nobody attaches; the job's own timeout (15 s) passes twice
        assert job.proc.poll() is None, job.stderr
        dialogue = pdb_session(base + 1, "p step", "c")
        assert "\n3\n" in dialogue
        assert job.wait(timeout=90) == 0, job.stderr
    finally:
        job.kill()
    found = parameters(job.stderr)
    assert set(found) == {"0", "1"} and found["0"] == found["1"], job.stderr
    assert job.stderr.count("rank 1 parked at") == 1
    assert "breakpod: [rank 0] rank 1 resumed; this rank continues" in job.stderr
    assert "stall:" not in job.stderr


@pytest.mark.slow  # about 40 s
@pytest.mark.timeout(180)
def test_a_real_hang_still_fails_within_the_process_group_timeout_with_a_stall_report(
    tmp_path: Path,
):
    base = free_ports(2)
    env = debug_env(base, STALL_RANK="1", STALL_AT="3", STEPS="8", STEP_SLEEP="0.1")
    job = Job(tmp_path, 2, 29472, **env)
    try:
        _, hung = job.wait_for(r"rank 1 stalls now", timeout=90)
        rc = job.wait(timeout=PG_TIMEOUT + 45)
        failed = time.monotonic() - hung
    finally:
        job.kill()
    assert rc != 0, job.stderr
    assert failed < PG_TIMEOUT + 25, (failed, job.stderr)
    match = re.search(r"^culprit: (.*)$", job.stderr, re.MULTILINE)
    assert match and match[1].startswith("rank 1 ("), job.stderr
    assert "fetch_batch" in match[1]
    assert "past the process group's timeout (15s), and no rank is parked" in job.stderr


@pytest.mark.slow  # about 50 s
@pytest.mark.timeout(240)
def test_a_rank_a_job_break_has_not_reached_waits_out_the_park(tmp_path: Path):
    """Rank 1 numbers its steps twice as fast, so the break lands at its step 2n while
    rank 0 waits in a collective at step n: it was not paused, its own 10 s timeout ran,
    and it ended the job mid-park; once the park ends, its wait counts from then."""
    base = free_ports(2)
    env = debug_env(
        base, BREAK_AT="5", FAST_RANK="1", STEPS="40", STEP_SLEEP="0.1", PG_TIMEOUT="10"
    )
    env["BREAKPOD_HOLD_SECONDS"] = "25"
    job = Job(tmp_path, 2, 29490, **env)
    try:
        job.wait_for(r"\[rank 1\] job-wide break at step \d+: waiting up to 25s", timeout=90)
        assert job.wait(timeout=120) == 0, job.stderr
    finally:
        job.kill()
    assert "no rank is parked" not in job.stderr and "stall:" not in job.stderr, job.stderr
    found = parameters(job.stderr)
    assert set(found) == {"0", "1"} and found["0"] == found["1"], job.stderr


@pytest.mark.slow  # about 30 s
@pytest.mark.timeout(180)
def test_a_rank_that_resumed_is_not_named_parked_at_the_next_pause(tmp_path: Path):
    base = free_ports(3)
    env = debug_env(base, PARKS="1:2,2:6", STEPS="9", STEP_SLEEP="0.1")
    env["BREAKPOD_HOLD_SECONDS"] = "3"
    job = Job(tmp_path, 3, 29492, **env)
    try:
        assert job.wait(timeout=120) == 0, job.stderr
    finally:
        job.kill()
    waits = re.findall(r"^breakpod: \[rank 0\] (.*); this rank waits at step (\d+)$",
                       job.stderr, re.MULTILINE)  # fmt: skip
    assert [step for _, step in waits] == ["2", "6"], job.stderr
    assert waits[1][0].startswith("rank 2 parked at") and "rank 1" not in waits[1][0], waits


@pytest.mark.slow  # about 20 s
@pytest.mark.timeout(180)
def test_a_hang_before_the_first_step_fails_within_the_process_group_timeout(tmp_path: Path):
    """Debug mode took it for the time before the first step, when a job may load for a
    long time, and the rank waited in DDP's first collective for hold + 30 minutes."""
    base = free_ports(2)
    env = debug_env(base, STALL_RANK="1", STALL_AT="0", STEPS="5", PG_TIMEOUT="10")
    job = Job(tmp_path, 2, 29494, **env)
    try:
        _, hung = job.wait_for(r"rank 1 stalls now", timeout=90)
        rc = job.wait(timeout=60)
        failed = time.monotonic() - hung
    finally:
        job.kill()
    assert rc != 0 and failed < 10 + 25, (failed, job.stderr)
    assert "past the process group's timeout (10s), and no rank is parked" in job.stderr


@pytest.mark.slow  # about 15 s
@pytest.mark.timeout(180)
def test_a_crash_held_in_post_mortem_is_named_where_it_raised(tmp_path: Path):
    """A post-mortem holds the process in the excepthook, whose stack no longer holds the
    frame that raised: its peers read "rank 1 parked at events.py:106 in _contained"."""
    base = free_ports(2)
    env = debug_env(base, CRASH_RANK="1", CRASH_AT="3", STEPS="8", STEP_SLEEP="0.1")
    env.update(BREAKPOD_POST_MORTEM="1", BREAKPOD_HOLD_SECONDS="3")
    job = Job(tmp_path, 2, 29496, **env)
    try:
        said, _ = job.wait_for(r"^breakpod: \[rank 0\] rank 1 parked at (.*)$", timeout=90)
        assert re.match(r"stall_job\.py:\d+ in main \(uncaught RuntimeError\); this", said[1])
        assert job.wait(timeout=90) != 0  # nobody attached: rank 1 exits, as it would have
    finally:
        job.kill()
    assert "[rank 1] uncaught RuntimeError at " in job.stderr, job.stderr


@pytest.mark.timeout(120)
def test_torchrun_told_to_stop_stops_without_a_post_mortem(tmp_path: Path):
    """SIGTERM (a pod's deletion) makes torchrun's agent raise SignalException, uncaught:
    with post-mortem on, the launcher parked for the hold time before it exited."""
    base = free_ports(2)
    env = debug_env(base, STEPS="100000", STEP_SLEEP="0.1")
    env.update(BREAKPOD_POST_MORTEM="1", BREAKPOD_HOLD_SECONDS="60")
    job = Job(tmp_path, 2, 29498, **env)
    try:
        job.wait_for(r"\[rank 1\] debug mode: ", timeout=90)
        job.proc.send_signal(signal.SIGTERM)  # torchrun itself, as the kubelet does
        assert job.wait(timeout=30) != 0, job.stderr
    finally:
        job.kill()
    assert "SignalException: the process was told to stop; no post-mortem" in job.stderr
    assert "waiting up to 60s" not in job.stderr, job.stderr
