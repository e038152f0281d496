"""Sharded jobs (real torchrun, gloo, CPU, two ranks): FSDP2 (``fully_shard``) and
FSDP1 (``FullyShardedDataParallel``). One token's gradient goes bad on its way into the
embedding, so only rows in rank 1's shard do: each rank alone would judge its own shard
and disagree (rank 1 skipping its rows' update, rank 0 applying its own, the model half
updated). breakpod sums the shards' squared norms over the ranks, so every rank judges
the full gradient's norm, the one an unsharded job has, and every rank decides alike.

A sharded model's step is not replayed: its forward gathers parameters from the other
ranks, and FSDP1's replay crashed the job before."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.torchrun import Job, free_ports, pdb_session

FSDP_JOB = Path(__file__).with_name("fsdp_job.py")
PORTS = {"2": 29510, "1": 29520, "hsdp": 29530, "1-unsharded": 29540, "ddp": 29550}
RANKS = {"2": 2, "1": 2, "hsdp": 4, "1-unsharded": 2, "ddp": 2}  # hsdp: 2 replicas of 2 shards


def run(tmp_path: Path, fsdp: str, offset: int, **env: str) -> str:
    port = PORTS[fsdp] + offset
    job = Job(tmp_path, RANKS[fsdp], port, FSDP_JOB, FSDP=fsdp, **{"BAD_AT": "3", **env})
    try:
        assert job.wait(timeout=100) == 0, job.stderr
    finally:
        job.kill()
    return job.stderr


def assert_both_skipped(stderr: str, follower: str, step: int) -> None:
    """``follower`` skipped ``step``'s update for the other rank, and no rank updated."""
    follows = f"[rank {follower}] step {step}: another rank skips this update, so this rank"
    assert follows in stderr, stderr
    assert said(stderr, "rows updated at the bad step") == {"0": "[]", "1": "[]"}, stderr


def said(stderr: str, what: str) -> dict[str, str]:
    """Each rank's line of ``what`` (the job writes ``rank N: what ...``)."""
    return dict(re.findall(rf"^rank (\d): {what} ?(.*)$", stderr, re.MULTILINE))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fsdp", "micro"), [("2", "1"), ("2", "2"), ("1", "1"), ("1-unsharded", "1")]
)
def test_a_nan_in_one_shard_is_found_and_skipped_by_every_rank(
    tmp_path: Path, fsdp: str, micro: str
) -> None:
    """NO_SHARD holds every gradient whole: nothing to sum, but its step is not replayed
    either (its backward all-reduces). FSDP2 accumulating over two backwards leaves the
    first without gradients on any rank (the norms of nothing failed every step)."""
    stderr = run(tmp_path, fsdp, 7 * (micro == "2"), POISON="nan", MICRO=micro)
    found = said(stderr, "found")
    assert set(found) == {"0", "1"}, stderr
    for line in found.values():
        assert re.match(r"step 3 backward (_fsdp_wrapped_module\.)?emb: \[nonfinite\]", line)
        assert "skipped=True" in line, stderr
    assert said(stderr, "rows updated at the bad step") == {"0": "[]", "1": "[]"}, stderr
    assert stderr.count("the model is under FSDP, so its step is not replayed") == 2
    assert "replay failed" not in stderr
    assert "failed (" not in stderr, stderr  # no monitor hook failed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fsdp", "check_every"), [("2", "1"), ("2", "10"), ("1", "1"), ("1", "10"), ("hsdp", "1")]
)
def test_a_spike_in_one_shard_is_judged_on_the_full_norm_by_every_rank(
    tmp_path: Path, fsdp: str, check_every: str
) -> None:
    """At ``check_every=10`` the fused optimizer's skip is decided on the device, from the
    summed norms: no rank reads before the update, and none applies it. Under HSDP the
    squares are summed over a replica's shards only (the replicas hold the same)."""
    ranks = {str(r) for r in range(RANKS[fsdp])}
    offset = 1 + int(check_every == "10")
    stderr = run(tmp_path, fsdp, offset, POISON="1e4", MAX_NORM="5", CHECK_EVERY=check_every)
    truth = {float(v) for v in said(stderr, "the embedding's gradient norm").values()}
    assert len(truth) == 1 and truth.pop() > 5, stderr  # the spike, gathered by the job
    found = said(stderr, "found")
    assert set(found) == ranks, stderr
    values = set()
    for line in found.values():
        assert "[spikes] gradient norm of" in line and "skipped=True" in line, stderr
        values.add(float(line.rpartition("value=")[2]))
    assert len(values) == 1, found  # every rank the same norm
    full = float(said(stderr, "the embedding's gradient norm")["0"])
    assert values.pop() == pytest.approx(full, rel=1e-5)  # the full gradient's, not a shard's
    assert said(stderr, "rows updated at the bad step") == dict.fromkeys(ranks, "[]"), stderr
    if check_every == "10":
        assert stderr.count("update skipped on the device") == 2, stderr


@pytest.mark.slow  # about 15 s: two ranks park, and a debugger attaches to each
@pytest.mark.timeout(150)
def test_pdb_on_a_parked_sharded_rank_reads_its_own_shard_without_calling_the_others(
    tmp_path: Path,
) -> None:
    """Both ranks park at the NaN. Through DTensor ops, a parameter's norm or NaN count is
    a collective, which rank 0, parked in its own debugger, never joins, or an error (the
    head's 3 rows on 2 ranks: "Cannot flatten unevenly sharded tensor"). The commands read
    rank 1's shard, and say so."""
    base = free_ports(2)
    env = {"ENABLE_REMOTE_DEBUG": "1", "BREAKPOD_PORT": str(base), "BREAKPOD_HOLD_SECONDS": "90"}
    job = Job(
        tmp_path, 2, PORTS["2"] + 5, FSDP_JOB, FSDP="2", BAD_AT="3", POISON="nan", PARK="1", **env
    )
    try:
        for rank in (0, 1):
            job.wait_for(rf"\[rank {rank}\] anomaly: .*: waiting up to 90s", timeout=60)
        dialogue = pdb_session(base + 1, "tgrad model", "tstat model.emb.weight", "c", timeout=20)
        pdb_session(base, "c", timeout=20)
        assert job.wait(timeout=60) == 0, job.stderr
    finally:
        job.kill()
    # row 7 of the embedding, rank 1's: its 4 values are NaN; rows 5-9 are rank 1's shard
    assert "emb.weight: |grad|=nan nan=4 (this rank's shard)" in dialogue, dialogue
    assert "tensor[5,4] f32 cpu 80b (this rank's shard of [10,4])" in dialogue, dialogue


@pytest.mark.timeout(120)
def test_a_module_watched_before_fsdp1_wrapped_it_says_what_to_watch_and_is_never_replayed(
    tmp_path: Path,
) -> None:
    """FSDP1 keeps the module's parameters (flattened into its shards) and wraps the module
    from outside, where the monitor cannot see its process group. The replay used to run
    the module's forward on the flat shards (``'weight' must be 2-D``)."""
    stderr = run(tmp_path, "1", 6, POISON="nan", WATCH_FIRST="1")
    assert stderr.count("watch the module that FullyShardedDataParallel returned") == 2, stderr
    assert stderr.count("so its step is not replayed") >= 1, stderr
    assert "replay failed" not in stderr, stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
def test_a_nan_loss_on_one_rank_alone_does_not_hang_the_job(tmp_path: Path) -> None:
    """Rank 1's loss alone is NaN (its gradients finite): rank 1 alone turns the detailed
    tier on, whose own norms made a second all-reduce a backward on rank 1 only. Rank 0
    then waited in FSDP's next all-gather, rank 1 in the monitor's: the job hung."""
    stderr = run(tmp_path, "2", 8, POISON="1", NAN_LOSS_RANK="1")
    assert re.search(r"^rank 1: found step 3 loss <model>: \[nonfinite\] loss is nan", stderr, re.M)
    assert "the detailed tier is on" in stderr, stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.slow  # the roll call waits 10 s for the rank that never watches
@pytest.mark.timeout(120)
def test_a_sharded_model_watched_on_one_rank_alone_is_judged_there_without_a_collective(
    tmp_path: Path,
) -> None:
    """Rank 1 never calls watch(). Rank 0's sum of the shards' norms would meet rank 1's
    next FSDP all-gather instead of a sum of its own: the job hung. The ranks answer a
    roll call in the job's store first, which costs rank 0 a wait, and rank 0 says so."""
    stderr = run(tmp_path, "2", 9, POISON="nan", WATCH_RANK="0")
    assert "1 of the 2 ranks that shard the model watch it (after 10 s)" in stderr, stderr
    assert re.search(r"^rank 0: found step \d+ ", stderr, re.M), stderr
    assert "rank 1: found" not in stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fsdp", "inner", "compiled"),
    [("ddp", "", ""), ("ddp", "1", ""), ("2", "", ""), ("ddp", "1", "1")],
)
def test_a_skip_one_rank_decides_alone_is_made_by_every_rank(
    tmp_path: Path, fsdp: str, inner: str, compiled: str
) -> None:
    """Rank 1's loss alone spikes (its own batch) and its loss_spike rule skips the
    update. Rank 0 saw no spike: it applied its update, and DDP's replicas parted (FSDP's
    model was updated in part). The skip is agreed at the update now, also when the
    module DDP wraps is the one watched (its replicas found in DDP's forward, or, compiled,
    among the layers of the wrapper its root hooks run on)."""
    spike = {"SPIKE_LOSS_RANK": "1", "LOSS_SKIP": "1", "WATCH_INNER": inner, "COMPILE": compiled}
    offset = 3 + len(inner) + 2 * len(compiled)
    stderr = run(tmp_path, fsdp, offset, POISON="1", BAD_AT="12", STEPS="15", **spike)
    assert re.search(r"^rank 1: found step 12 loss <model>: \[lspike\]", stderr, re.M), stderr
    assert not re.search(r"^rank 0: found step 12 loss", stderr, re.M)  # rank 0's loss: calm
    assert_both_skipped(stderr, follower="0", step=12)
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
def test_a_monitor_closed_on_one_replica_leaves_at_the_next_update_and_follows_its_skip(
    tmp_path: Path,
) -> None:
    """Rank 1 closes its monitor after step 11; rank 0's loss spikes at step 12, and its
    rule skips that update. Rank 0's agreement met rank 1's next DDP all-reduce instead
    (gloo aborted the job: "Received data size doesn't match expected size"). Rank 1 now
    makes one last agreement at its next update, saying it leaves, and follows the skip."""
    spike = {"SPIKE_LOSS_RANK": "0", "LOSS_SKIP": "1", "CLOSE_RANK": "1", "CLOSE_AT": "11"}
    stderr = run(tmp_path, "ddp", 11, POISON="1", BAD_AT="12", STEPS="15", **spike)
    assert re.search(r"^rank 0: found step 12 loss <model>: \[lspike\]", stderr, re.M), stderr
    assert "[rank 0] step 12: 1 of the 2 ranks closed their monitor" in stderr, stderr
    assert "[rank 1] step 12: this rank's monitor closed: it left its peers' agreements" in stderr
    assert_both_skipped(stderr, follower="1", step=12)
    assert "rank 1: found" not in stderr  # its monitor closed before
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("closing", "offset"), [("1", 11), ("all", 12)])
def test_a_sharded_model_whose_monitor_closes_on_some_ranks_trains_on(
    tmp_path: Path, closing: str, offset: int
) -> None:
    """Each backward sums the shards' gradient norms over the ranks: rank 1 closing alone
    after step 4 left rank 0 waiting in the next sum (the job hung). Rank 1's monitor now
    goes on watching, and finds the NaN of step 8, until every rank's has closed; ranks
    that all close go at the next backward, and say nothing."""
    stderr = run(
        tmp_path,
        "2",
        offset,
        POISON="nan",
        BAD_AT="8",
        STEPS="10",
        CLOSE_AT="4",
        CLOSE_RANK=closing,
    )
    found = said(stderr, "found")
    waits = "[rank 1] monitor: closed on this rank while other ranks still watch the sharded"
    if closing == "1":
        assert waits in stderr, stderr
        assert set(found) == {"0", "1"}, stderr
        assert all(line.startswith("step 8 backward emb: [nonfinite]") for line in found.values())
        assert said(stderr, "rows updated at the bad step") == {"0": "[]", "1": "[]"}, stderr
    else:  # both closed for good: their step hooks are gone (but the departures' own)
        assert "monitor: closed on this rank" not in stderr, stderr
        assert found == {}, stderr
        assert said(stderr, "optimizer step pre-hooks left") == {"0": "1", "1": "1"}, stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fsdp", "offset"), [("ddp", 12), ("2", 13)])
def test_a_monitor_that_fails_on_one_rank_never_leaves_the_others_waiting(
    tmp_path: Path, fsdp: str, offset: int
) -> None:
    """Rank 1's monitor fails inside each step's end and each backward's norms from step 10
    on (a fault injected into the agent); rank 0's loss spikes at step 12, and its rule
    skips that update. The failure skipped rank 1's agreement (gloo aborted a DDP job, an
    FSDP one hung in the norms' sum). Whatever fails, this rank's part is made: rank 1
    follows the skip, and says what failed."""
    faults = {"FAIL_RANK": "1", "FAIL_AT": "10", "SPIKE_LOSS_RANK": "0", "LOSS_SKIP": "1"}
    stderr = run(tmp_path, fsdp, offset, POISON="1", BAD_AT="12", STEPS="15", **faults)
    assert re.search(r"^rank 0: found step 12 loss <model>: \[lspike\]", stderr, re.M), stderr
    assert_both_skipped(stderr, follower="1", step=12)
    failed = re.findall(r"\[rank (\d)\] monitor .* failed \(RuntimeError: a fault injected", stderr)
    assert set(failed) == {"1"}, stderr


@pytest.mark.timeout(120)
def test_a_monitor_made_anew_each_epoch_on_every_rank_agrees_and_leaves_one_hook(
    tmp_path: Path,
) -> None:
    """Every rank closes its monitor and watches anew every 5 steps (``with watch(...)`` an
    epoch). Each close leaves one last agreement at the next update, made by every rank at
    once, before the new monitor's own; a spike of rank 1's loss in the third epoch is
    still skipped by both. The optimizer keeps one hook for all those departures, not one
    an epoch."""
    spike = {"SPIKE_LOSS_RANK": "1", "LOSS_SKIP": "1", "REWATCH_EVERY": "5"}
    stderr = run(tmp_path, "ddp", 13, POISON="1", BAD_AT="13", STEPS="15", **spike)
    assert re.search(r"^rank 1: found step 3 loss <model>: \[lspike\]", stderr, re.M), stderr
    assert_both_skipped(stderr, follower="0", step=3)
    assert stderr.count("this rank's monitor closed: it left its peers' agreements") == 4
    assert "ranks closed their monitor" not in stderr  # all left at once: nobody stays
    assert said(stderr, "optimizer step pre-hooks left") == {"0": "1", "1": "1"}, stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
def test_ddp_accumulating_under_no_sync_keeps_the_loops_steps(tmp_path: Path) -> None:
    """Two backwards a step, the first under DDP's ``no_sync()``; both NaN at step 3. DDP's
    synced backward writes each gradient twice (accumulated, then averaged), which once
    read as gradients zeroed in place: the step ended a backward early, the NaN update was
    applied, and the monitor's steps ran ahead of the loop's."""
    stderr = run(tmp_path, "ddp", 14, POISON="nan", MICRO="2", STEPS="6")
    found = said(stderr, "found")
    assert set(found) == {"0", "1"}, stderr
    for line in found.values():
        assert re.match(r"step 3 backward module\.emb: \[nonfinite\]", line), stderr
        assert "skipped=True" in line, stderr
    assert said(stderr, "rows updated at the bad step") == {"0": "[]", "1": "[]"}, stderr
    assert "failed (" not in stderr, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("wait", "offset"), [("5", 14), ("0", 15)])
def test_a_sharded_model_watched_anew_each_epoch_agrees_when_a_rank_closes_late(
    tmp_path: Path, wait: str, offset: int
) -> None:
    """FSDP2, a monitor an epoch, rank 1 closing 1 s after rank 0 each time. Rank 0's
    monitor waits at close() for rank 1's; told not to wait, it goes on until rank 1's
    close, and its last agreement came after its new monitor's: the two ranks' agreements
    crossed, every rank went alone, and rank 1 skipped its spike alone (the sharded model
    updated in part). The last agreements come first on every rank now."""
    spike = {"SPIKE_LOSS_RANK": "1", "LOSS_SKIP": "1", "REWATCH_EVERY": "5", "LATE_RANK": "1"}
    stderr = run(
        tmp_path, "2", offset, POISON="1", BAD_AT="13", STEPS="15", CLOSE_WAIT=wait, **spike
    )
    assert re.search(r"^rank 1: found step 3 loss <model>: \[lspike\]", stderr, re.M), stderr
    assert_both_skipped(stderr, follower="0", step=3)
    assert "ranks closed their monitor" not in stderr, stderr  # nobody left alone
    assert "failed (" not in stderr, stderr
