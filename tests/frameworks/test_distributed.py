"""Two ranks under torchrun (gloo, CPU), debug mode and no breakpod line: a rank that hangs
in its step is named the culprit, with its frame; a breakpoint() on one rank holds the
whole job past its process group's timeout, and one `c` resumes it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.torchrun import pdb_session
from tests.frameworks.jobs import Torchrun, free_ports

CULPRIT = r"^culprit: (.*)$"


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Torchrun] = []

    def start(name: str, **env: str) -> Torchrun:
        jobs.append(Torchrun(tmp_path, name, 2, ENABLE_REMOTE_DEBUG="1", **env))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["plain", "lightning_fit"])
def test_a_rank_hanging_in_its_step_is_named_with_its_frame(torchrun: Any, name: str) -> None:
    """Lightning DDP gave no stall report at all: its loop never calls breakpod.step()."""
    job = torchrun(name, HANG_RANK="1", HANG_AT="3", BREAKPOD_STALL_AFTER="5", STEPS="8")
    job.wait_for(r"rank 1 hangs at step 3", timeout=100)
    match, _ = job.wait_for(CULPRIT, timeout=30)
    assert match[1].startswith("rank 1 (step "), job.stderr
    assert re.search(r"common\.py:\d+ in user_step", match[1]), match[1]
    assert re.search(r"^rank 0: step \d+, in collective", job.stderr, re.M), job.stderr


@pytest.mark.slow  # a 25 s park past the plain loop's 20 s process group timeout
@pytest.mark.timeout(200)
def test_a_breakpoint_on_one_rank_holds_the_job_past_its_timeout_and_c_resumes_it(
    torchrun: Any,
) -> None:
    base = free_ports(2)
    job = torchrun(
        "plain",
        BREAK_RANK="1",
        BREAK_AT="2",
        PYTHONBREAKPOINT="breakpod.set_trace",
        BREAKPOD_PORT=str(base),
        BREAKPOD_HOLD_SECONDS="120",
    )
    job.wait_for(r"\[rank 1\] breakpoint\(\) at .*waiting up to", timeout=100)
    job.wait_for(r"^breakpod: \[rank 0\] rank 1 parked at", timeout=15)
    time.sleep(25)  # nobody attaches; the process group's own timeout (20 s) passes
    assert job.proc.poll() is None, job.stderr
    dialogue = pdb_session(base + 1, "p step", "c")
    assert "\n2\n" in dialogue, dialogue
    assert job.wait(timeout=90) == 0, job.stderr
    assert job.stderr.count("finished rank") == 2 and "stall:" not in job.stderr, job.stderr


# what each framework's ranks say of a NaN born on rank 1 (its block's 4th forward)
NAN_ON_ONE_RANK = {
    # debug mode watches the module DDP holds (accelerate wraps it), under bf16 autocast.
    # The NaN is the data's: rank 1's replay makes it again and names the module; rank
    # 0's own step replays finite, so the NaN came through the all-reduce (its detailed
    # tier stays off). DDP hands a None gradient to an output no loss used: the capture
    # read it and the job died in its first backward.
    "hf_trainer": (
        {"REPLAYABLE": "1", "BF16": "1"},
        [
            r"\[rank 1\] anomaly: step 4 forward transformer\.h\.1\.mlp: \[nonfinite\] output",
            r"\[rank 0\] monitor: step 4's non-finite value was not localized on this rank: "
            r"its own step replayed finite, .*from another rank",
        ],
        [r"the detailed tier is on", r"replay failed"],
    ),
    # two microbatches a step, the NaN in the first (forward 8: step 4), on rank 1: its
    # backward's end is read on a CPU, and rank 1 replays it there. Rank 0's first backward
    # ended finite, so its NaN came in through the all-reduce of the second (it said "from
    # an earlier forward, or ...", and turned its detailed tier on)
    "hf_trainer accumulating": (
        {"REPLAYABLE": "1", "ACCUMULATE": "2", "NAN_AT": "8"},
        [
            r"\[rank 1\] anomaly: step 4 forward transformer\.h\.1\.mlp: \[nonfinite\] output",
            r"\[rank 0\] monitor: step 4's non-finite value was not localized on this rank: "
            r"its own step replayed finite, .*from another rank",
        ],
        [r"the detailed tier is on", r"replay failed", r"earlier"],
    ),
    # Lightning's DDP runs training_step through the LightningModule's forward, patched
    # for that call: the replay runs that patch again (a replay once failed in the missing
    # forward; then no step was replayed, and the detailed tier was on from the start)
    "lightning_fit": (
        {"REPLAYABLE": "1"},
        [
            r"\[rank 1\] anomaly: step 4 forward net\.block: \[nonfinite\] output of net\.block",
            r"\[rank 0\] monitor: step 4's non-finite value was not localized on this rank: "
            r"its own step replayed finite, .*from another rank",
        ],
        [r"the detailed tier is on", r"replay failed", r"\[rank 1\] .*from another rank"],
    ),
    # a fault that counts its calls: rank 1's replay is finite where its step's loss was
    # not, so it did not reproduce (it said "from another rank", as every rank did)
    "lightning_fit unreplayable": (
        {},
        [
            r"\[rank 1\] monitor: step 4's non-finite value was not localized: its replay did "
            r"not reproduce it .*the detailed tier is on",
            r"\[rank 0\] monitor: step 4's non-finite value was not localized on this rank: "
            r"its own step replayed finite, .*from another rank",
        ],
        [r"\[rank 1\] .*from another rank"],
    ),
    # the detailed tier, chosen: rank 1 names the module live; rank 0 names the first
    # averaged gradient, and says it came from another rank
    "lightning_fit detailed": (
        {"BREAKPOD_MONITOR_TIER": "detailed"},
        [
            r"\[rank 1\] anomaly: step 4 forward net\.block: \[nonfinite\] output of net\.block",
            r"\[rank 0\] anomaly: step 4 backward .*: \[nonfinite\] gradient of .*; this rank's "
            r"forward, loss and backward ran finite, .*from another rank",
        ],
        [r"\[rank 1\] .*from another rank"],
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(NAN_ON_ONE_RANK))
def test_a_nan_on_one_rank_is_skipped_by_both_and_each_rank_says_what_it_knows(
    torchrun: Any, name: str
) -> None:
    """No breakpod line: debug mode, DDP as the framework sets it up, two ranks."""
    env, said, unsaid = NAN_ON_ONE_RANK[name]
    job = torchrun(
        name.split()[0],
        **{"NAN_AT": "4", "NAN_RANK": "1", **env},
        BREAKPOD_PORT=str(free_ports(2)),
        BREAKPOD_HOLD_SECONDS="0.5",
        BREAKPOD_ON_EXPIRE="skip",
    )
    assert job.wait(timeout=180) == 0, job.stderr
    err = job.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] step 4: update skipped" in err, err
        assert f"finished rank {rank} finite=True" in err, err
    for line in said:
        assert re.search(line, err), (line, err)
    for line in unsaid:
        assert not re.search(line, err), (line, err)
