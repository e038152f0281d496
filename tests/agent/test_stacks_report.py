"""The job report's verdicts, over threads as py-spy or the agent read them (pure)."""

from __future__ import annotations

import threading

from breakpod._cli import stacks_report as report
from breakpod._job import thread_stacks
from breakpod._job.thread_stacks import Frame, Thread
from breakpod._link import commands

SITE = "/venv/lib/python3.11/site-packages/torch"
TRAIN = Frame("main", "/app/train.py", 40)


def rank(n: int, *inner: Frame) -> report.Process:
    return report.Process(pid=100 + n, rank=n, threads=[Thread("MainThread", (TRAIN, *inner))])


def all_reduce() -> tuple[Frame, ...]:
    return (
        Frame("wrapper", f"{SITE}/distributed/c10d_logger.py", 81),
        Frame("all_reduce", f"{SITE}/distributed/distributed_c10d.py", 2810),
    )


def helper() -> Frame:
    return Frame("load_shard", "/app/data.py", 12)


def test_the_rank_outside_the_collective_is_blamed_with_its_frame() -> None:
    text, blamed = report.report(
        [rank(0, *all_reduce()), rank(1, helper()), rank(2, *all_reduce())], "stacks: 3 ranks"
    )
    assert [p.rank for p in blamed] == [1]
    assert text.splitlines()[1:4] == [
        "culprit: rank 1 at data.py:12 in load_shard (not in all_reduce, which ranks 0,2 wait in)",
        "ranks 0,2: in collective all_reduce, at train.py:40 in main",
        "rank 1: in user code, at data.py:12 in load_shard",
    ]


def test_ddps_reducer_in_native_frames_is_a_collective() -> None:
    reducer = Frame("c10d::Reducer::finalize_backward", "libtorch_cpu.so", 0, native=True)
    backward = Frame("backward", f"{SITE}/autograd/__init__.py", 395)
    assert report.place(rank(0, backward, reducer)) == report.Place(
        report.COLLECTIVE, "DDP's gradient all_reduce", "train.py:40 in main"
    )
    assert report.place(rank(0, backward)).state == report.BACKWARD


def test_a_model_running_under_ddps_forward_is_in_user_code() -> None:
    ddp = Frame("DistributedDataParallel.forward", f"{SITE}/nn/parallel/distributed.py", 1640)
    call = Frame("Module._call_impl", f"{SITE}/nn/modules/module.py", 1784)
    model = Frame("Net.forward", "/app/model.py", 21)
    linear = Frame("Linear.forward", f"{SITE}/nn/modules/linear.py", 134)
    assert report.place(rank(0, ddp, call, model, call, linear)) == report.Place(
        report.USER, "", "model.py:21 in Net.forward"
    )


def test_nobody_is_blamed_when_level_mismatched_or_alone() -> None:
    barrier = Frame("barrier", f"{SITE}/distributed/distributed_c10d.py", 4100)
    same = {"rank 0": report.place(rank(0, *all_reduce())), "rank 1": report.place(rank(1))}
    assert report.culprits({k: same["rank 0"] for k in ("rank 0", "rank 1")}) == (
        [],
        "every rank is inside all_reduce",
    )
    mixed = {"rank 0": same["rank 0"], "rank 1": report.place(rank(1, barrier))}
    assert report.culprits(mixed) == (
        [],
        "ranks wait in different collectives (all_reduce: rank 0; barrier: rank 1)",
    )
    assert report.culprits({"rank 1": same["rank 1"]})[0] == []
    assert report.culprits({"rank 0": same["rank 1"], "rank 1": same["rank 1"]}) == (
        [],
        "no rank waits in a collective",
    )


def test_an_unread_rank_is_never_blamed_and_says_why() -> None:
    unread = report.Process(pid=7, rank=1, error="no process 7 (it ended)")
    text, blamed = report.report([rank(0, *all_reduce()), unread], "stacks: 2 ranks")
    assert blamed == []
    assert "rank 1: stacks not read: no process 7 (it ended)" in text


def test_the_agents_answers_get_the_same_summary() -> None:
    """``breakpod stacks JOB``: each agent's own dump, as text, read back."""
    texts = [
        thread_stacks.format_threads(rank(0, *all_reduce()).threads),
        thread_stacks.format_threads(rank(1, helper()).threads),
        None,
    ]
    sessions = [{"id": f"s{n}", "job": "j", "rank": n, "pid": 10 + n} for n in range(3)]
    assert report.agent_summary(sessions, texts, 5.0).splitlines() == [
        "stacks: 3 ranks of job j, from their agents",
        "culprit: rank 1 at data.py:12 in load_shard (not in all_reduce, which rank 0 waits in)",
        "rank 0: in collective all_reduce, at train.py:40 in main",
        "rank 1: in user code, at data.py:12 in load_shard",
        "rank 2: stacks not read: no answer within 5s",
    ]


def deep(n: int, done: threading.Event) -> None:
    if n:
        deep(n - 1, done)
    else:
        done.wait()


def test_a_long_dump_keeps_the_main_thread() -> None:
    """The answer to dump-stacks is cut to its first 10,000 characters: the user's
    threads lead, so the main thread is in it however many threads there are."""
    done = threading.Event()
    threads = [threading.Thread(target=deep, args=(30, done), daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    try:
        ok, text = commands.do_dump_stacks()
    finally:
        done.set()
    assert ok and text.startswith('Thread "MainThread"')
    assert len(text) == commands.MAX_DETAIL
