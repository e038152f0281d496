"""The sentinel tier under DDP (real torchrun, gloo, CPU, three ranks): one rank's batch
holds a NaN, and DDP's all-reduce spreads it into every rank's gradients.

Each rank reads the averaged gradients, not its own (its end of backward waits for DDP's
reducer to finish), so every rank finds the step before its update. The rank with the
bad batch names it by replay; a replay runs the module DDP holds, never DDP's forward,
whose all-reduce the other ranks would never join. The others say the NaN came from
another rank, and do not turn their detailed tier on for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.torchrun import Job

NAN_JOB = Path(__file__).with_name("nan_job.py")


@pytest.mark.timeout(120)
def test_a_nan_batch_on_one_rank_is_named_there_and_the_others_say_where_it_came_from(
    tmp_path: Path,
) -> None:
    """(The module DDP holds, watched as debug mode sees it: tests/frameworks/
    test_distributed.py, HF Trainer on two ranks.)"""
    job = Job(tmp_path, 3, 29176, NAN_JOB, BAD_RANK="2", BAD_AT="3")
    try:
        assert job.wait(timeout=100) == 0, job.stderr
    finally:
        job.kill()
    found = dict(re.findall(r"^found on rank (\d): (.*)$", job.stderr, re.MULTILINE))
    assert found["2"].startswith(
        "step 3 input module.0: [nonfinite] input of module.0 (the batch) has non-finite values"
    ), job.stderr
    assert "how=replay | replayed in" in found["2"]
    for rank in ("0", "1"):
        assert found[rank].startswith("step 3 backward module.0: [nonfinite] gradient of"), found
        assert "its own step replayed finite" in found[rank]
        assert "from another rank" in found[rank]
    assert "the detailed tier is on" not in job.stderr
    assert "replay failed" not in job.stderr


@pytest.mark.timeout(120)
def test_a_nan_from_an_earlier_forward_of_the_step_is_never_blamed_on_another_rank(
    tmp_path: Path,
) -> None:
    """Two forwards before one backward; rank 1's first holds the NaN. Each rank's
    capture holds the last forward, which replays finite: the NaN may come from the
    earlier one or from another rank, and each rank says both (rank 1 was told it came
    from another rank, which was false)."""
    job = Job(tmp_path, 2, 29196, NAN_JOB, BAD_RANK="1", BAD_AT="3", FORWARDS="2")
    try:
        assert job.wait(timeout=100) == 0, job.stderr
    finally:
        job.kill()
    found = dict(re.findall(r"^found on rank (\d): (.*)$", job.stderr, re.MULTILINE))
    for rank in ("0", "1"):
        assert found[rank].startswith("step 3 backward module.0: [nonfinite]"), found
        assert (
            "came from an earlier one, or through DDP's all-reduce from another rank"
            in (found[rank])
        ), found
        assert "its own step replayed finite" not in found[rank], found
