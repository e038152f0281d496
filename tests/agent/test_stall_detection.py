"""Stall detection from the environment: bad input, off means off, culprits, debug default."""

from __future__ import annotations

import socket

import pytest

from breakpod._core.errors import ConfigError
from breakpod._job import stall_report, watchdog


def rec(step: int, entered: int, state: str = "user", frame: str = "t.py:1 in f") -> dict:
    return {"step": step, "entered": entered, "state": state, "frame": frame, "op": "all_reduce"}


def test_the_rank_outside_the_collective_is_the_culprit_never_the_waiting_ones():
    records = {0: rec(5, 7, "collective"), 1: rec(5, 6), 2: rec(5, 7, "collective")}
    assert stall_report.culprits(records)[0] == [1]


def test_without_a_collective_the_slowest_step_counter_is_blamed():
    assert stall_report.culprits({0: rec(9, 0), 1: rec(4, 0), 2: rec(9, 0)})[0] == [1]


def test_a_level_job_blames_nobody():
    blamed, why = stall_report.culprits({0: rec(3, 2, "collective"), 1: rec(3, 2, "collective")})
    assert blamed == [] and "every rank" in why
    text, _ = stall_report.job_report({0: rec(3, 2, "collective")}, 2, 5.0)
    assert "culprit: none found" in text and "rank 1: no status published" in text


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "inf"])
def test_a_bad_stall_after_is_one_line_naming_the_variable_and_the_job_runs_on(spawn, raw):
    child = spawn(
        """
        import threading, breakpod
        for _ in range(5):
            breakpod.step()
        print(threading.active_count())
        """,
        env={"BREAKPOD_STALL_AFTER": raw},
    )
    assert child.wait() == 0, child.stderr
    assert child.stdout().strip() == "1"
    lines = [line for line in child.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "BREAKPOD_STALL_AFTER" in lines[0]
        and "stall detection is off" in lines[0]
    )


def test_a_break_re_arms_step_without_reading_the_environment_again(spawn):
    """``breakpod.step()`` parks after a ``break`` though stall detection is off; the
    bad setting is announced once, not again at each break."""
    child = spawn(
        """
        import breakpod
        from breakpod._link import commands
        for _ in range(3):
            commands.do_break()
            breakpod.step()  # parks; nobody attaches within the hold time
            breakpod.step()
        """,
        env={"BREAKPOD_STALL_AFTER": "abc", "BREAKPOD_HOLD_SECONDS": "0.2"},
    )
    assert child.wait(timeout=60) == 0, child.stderr
    assert child.stderr.count("stall detection is off") == 1, child.stderr
    assert child.stderr.count("break requested through the broker") == 3, child.stderr


def test_disabled_means_no_thread_and_no_hooks(spawn):
    child = spawn(
        """
        import threading
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        forward, all_reduce = DistributedDataParallel.forward, dist.all_reduce
        import breakpod
        for _ in range(50):
            breakpod.step()
        from breakpod._job import boundary
        hooked = DistributedDataParallel.forward is not forward or dist.all_reduce is not all_reduce
        print(threading.active_count(), hooked, boundary._armed)
        """,
        env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29199"},
    )
    assert child.wait(timeout=60) == 0, child.stderr
    assert child.stdout().split() == ["1", "False", "False"]
    assert child.stderr == ""


def test_a_rank_that_cannot_reach_the_store_reports_alone_and_says_why(spawn):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = spawn(
        """
        import threading, torch, breakpod

        def load_batch():
            threading.Event().wait()

        breakpod.step()
        load_batch()
        """,
        env={
            "BREAKPOD_STALL_AFTER": "1",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        },
    )
    child.wait_for(
        r"stall: rank 1: no step for \d+s; step 1, in user code, at \S+ in load_batch", 40
    )
    child.wait_for(rf"no job view: cannot reach the job store at 127.0.0.1:{port}", 5)
    child.wait_for(r"stacks of rank 1:\n(.*\n)*.*in load_batch", 5)
    assert child.proc.poll() is None  # the job is not harmed


def test_debug_mode_derives_the_timeout_from_step_times_with_a_floor():
    assert watchdog.stall_timeout_from_env({"ENABLE_REMOTE_DEBUG": "1"}) == (
        watchdog.DEBUG_FLOOR,
        True,
    )
    assert watchdog.stall_timeout_from_env({}) is None
    assert watchdog.stall_timeout_from_env({"BREAKPOD_STALL_AFTER": "2.5"}) == (2.5, False)
    with pytest.raises(ConfigError, match="BREAKPOD_STALL_AFTER"):
        watchdog.stall_timeout_from_env({"BREAKPOD_STALL_AFTER": "soon"})
    dog = watchdog.Watchdog(60, adaptive=True)
    dog.durations.extend([0.1] * 99)  # type: ignore[union-attr]
    assert dog.current_timeout() == 60  # the floor
    dog.durations.extend([20.0] * 5)  # type: ignore[union-attr]
    assert dog.current_timeout() == 200  # 10x the p99


def test_step_numbers_count_themselves_when_not_given():
    dog = watchdog.Watchdog(60)
    dog.beat()
    dog.beat()
    dog.beat(10)
    dog.beat()
    assert dog.step == 11


COMPILED_COLLECTIVE = """
import sys
import torch
import torch.distributed as dist
from breakpod._job import collectives

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
collectives.install()  # as stall detection does


def double_the_sum(t):
    dist.all_reduce(t)  # a collective inside a compiled region (SyncBatchNorm makes some)
    return t * 2


run = torch.compile(double_the_sum, backend="eager", fullgraph=True)
print("out", run(torch.ones(3)).tolist())
dist.all_reduce(torch.ones(1))  # eagerly: counted
print("counted", collectives.progress.entered)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_collective_in_a_fullgraph_compiled_region_runs_with_the_counters_installed(
    spawn, tmp_path
):
    """The counting wrapper takes a lock, which dynamo cannot trace: a collective inside
    ``torch.compile(fullgraph=True)`` failed the compile. Inside a trace it is the
    original collective now (not counted); outside, counted as before."""
    child = spawn(COMPILED_COLLECTIVE, args=[str(tmp_path / "store")])
    assert child.wait(timeout=100) == 0, child.stderr
    out = child.stdout()
    assert "out [2.0, 2.0, 2.0]" in out, child.stderr
    assert "counted 1" in out, out


def two_ranks(run: str) -> str:
    """A job of two processes over gloo with the collectives counted, as stall detection
    counts them; ``run`` defines ``run(rank)``, each rank's part between the two."""
    return (
        """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from breakpod._job import collectives
"""
        + run
        + """

def rank_main(rank, store):
    collectives.install()  # as stall detection does in a job of several ranks
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    torch.manual_seed(0)
    run(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
"""
    )


DDP_IN_A_GROUP = two_ranks("""
def run(rank):
    groups = [dist.new_group([0]), dist.new_group([1])]  # a data-parallel group per stage
    model = torch.nn.Linear(2, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=groups[rank])
    ddp(torch.full((1, 2), float(rank + 1))).sum().backward()
    print(f"rank {rank} grad {model.weight.grad.tolist()}", flush=True)
""")


@pytest.mark.timeout(120)
def test_ddp_over_its_own_group_averages_over_that_group_with_the_counters_installed(
    spawn, tmp_path
):
    """DDP's buckets are counted by a comm hook; its state was None, which averages each
    bucket over the whole world: two stages' groups of one rank each got each other's
    gradients ([1.5, 1.5] on both, where DDP alone gives [1, 1] and [2, 2])."""
    child = spawn(DDP_IN_A_GROUP, args=[str(tmp_path / "store")])
    assert child.wait(timeout=100) == 0, child.stderr
    out = child.stdout()
    assert "rank 0 grad [[1.0, 1.0]]" in out and "rank 1 grad [[2.0, 2.0]]" in out, (
        out,
        child.stderr,
    )


A_HOOK_AFTER_THE_FIRST_FORWARD = two_ranks("""
def summed(state, bucket):  # the job's own hook: a sum where DDP would average
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def run(rank):
    model = torch.nn.Linear(2, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    out = ddp(torch.full((1, 2), float(rank + 1)))  # a warm-up forward: the counting hook
    ddp.register_comm_hook(None, summed)
    before = collectives.progress.completed
    out.sum().backward()
    counted = collectives.progress.completed - before
    print(f"rank {rank} grad {model.weight.grad.tolist()} counted {counted}", flush=True)
    try:
        ddp.register_comm_hook(None, summed)
    except RuntimeError as refused:
        print(f"rank {rank} again: {refused}", flush=True)
""")


@pytest.mark.timeout(120)
def test_a_comm_hook_the_job_registers_after_the_first_forward_runs_and_is_counted(spawn, tmp_path):
    """DDP takes one comm hook, and the counting one is registered at DDP's first forward:
    a job that registered its own after a warm-up forward died in DDP's "can only be
    called once". Its hook now runs inside the counting one; a second is refused as DDP
    refuses it."""
    child = spawn(A_HOOK_AFTER_THE_FIRST_FORWARD, args=[str(tmp_path / "store")])
    assert child.wait(timeout=100) == 0, child.stderr
    out = child.stdout()
    for rank in (0, 1):  # summed, not averaged (1 + 2); the bucket and the hook's all_reduce
        assert f"rank {rank} grad [[3.0, 3.0]] counted 2" in out, (out, child.stderr)
        assert f"rank {rank} again: " in out and "only be called once" in out, out
