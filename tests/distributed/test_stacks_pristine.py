"""``breakpod stacks --pid`` on real torchrun jobs (gloo, CPU) that never imported
breakpod, read with the real py-spy: the culprit, a spinning rank, a level job, a
launcher's PID against its ranks' PIDs, a lone process, and processes py-spy may not read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.torchrun import Job

PRISTINE = Path(__file__).with_name("pristine_job.py")
SPY = Path(sys.executable).with_name("py-spy")
pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not SPY.exists(), reason="py-spy is not installed (requirements-dev.txt)"),
]


def stacks(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "breakpod._cli.main", "stacks", *args]
    if user:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def report(*args: str) -> dict[str, Any]:
    done = stacks(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


Start = Callable[..., Job]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    jobs: list[Job] = []

    def run(port: int, *ready: str, **env: str) -> Job:
        job = Job(tmp_path, 3, port, PRISTINE, **env)
        jobs.append(job)
        for pattern in ready:
            job.wait_for(pattern, timeout=45)
        return job

    yield run
    for job in jobs:
        job.kill()


def places(doc: dict[str, Any]) -> dict[int, tuple[str, str, str]]:
    return {p["rank"]: (p["state"], p["op"], p["frame"]) for p in doc["processes"]}


def test_a_rank_blocked_in_python_is_the_culprit(start: Start) -> None:
    job = start(29631, "rank 1 stalls now", "rank 0 at step 3", "rank 2 at step 3", STALL_RANK="1")
    time.sleep(1.0)  # ranks 0 and 2 reach DDP's all_reduce of step 3
    done = stacks("--pid", str(job.proc.pid))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("stacks: 3 ranks under launcher pid")
    assert lines[1].startswith("culprit: rank 1 at pristine_job.py:")
    assert "in load_shard (not in DDP's gradient all_reduce, which ranks 0,2 wait in)" in lines[1]
    assert "ranks 0,2: in collective DDP's gradient all_reduce, at pristine_job.py:" in done.stdout
    assert lines[4].startswith("=== rank 1 (pid ")  # the culprit's stacks first


def test_a_spinning_rank_is_the_culprit(start: Start) -> None:
    job = start(29632, r"rank 2 stalls now", STALL_RANK="2", STALL_KIND="spin")
    time.sleep(2.0)
    doc = report("--pid", str(job.proc.pid))
    assert [c["rank"] for c in doc["culprit"]] == [2], doc["why"]
    state, _, frame = places(doc)[2]
    assert state == "user code" and frame.endswith("in spin")


def test_a_level_job_blames_nobody(start: Start) -> None:
    job = start(
        29633, "rank 0 waits level", "rank 1 waits level", "rank 2 waits level", LEVEL_AT="2"
    )
    time.sleep(1.0)
    doc = report("--pid", str(job.proc.pid))
    assert doc["culprit"] == [] and doc["why"] == "every rank is inside recv"
    assert {p[0] for p in places(doc).values()} == {"collective"}


def test_rank_pids_give_the_launchers_report(start: Start) -> None:
    """The ranks' DataLoader workers inherit RANK: they are not ranks of their own."""
    job = start(29634, r"rank 0 stalls now", STALL_RANK="0", STALL_AT="2", WORKERS="1")
    time.sleep(1.0)
    by_launcher = report("--pid", str(job.proc.pid))
    pids = [str(p["pid"]) for p in by_launcher["processes"]]
    assert [p["rank"] for p in by_launcher["processes"]] == [0, 1, 2]
    assert all(p["launcher"] == job.proc.pid for p in by_launcher["processes"])
    by_ranks = report("--pid", *pids)
    assert (
        [c["rank"] for c in by_ranks["culprit"]]
        == [0]
        == [c["rank"] for c in by_launcher["culprit"]]
    )
    assert {p["rank"]: p["launcher"] for p in by_ranks["processes"]} == {0: None, 1: None, 2: None}


def test_a_lone_process(tmp_path: Path) -> None:
    code = (
        "import time\ndef wait_here():\n    time.sleep(60)\nprint('up', flush=True)\nwait_here()\n"
    )
    (tmp_path / "lone.py").write_text(code)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "lone.py")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        done = stacks("--pid", str(proc.pid))
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[1:3] == [
            "culprit: none found (a single process: nothing to compare it with)",
            f"pid {proc.pid}: in user code, at lone.py:3 in wait_here",
        ]
        assert f'=== pid {proc.pid} ===\nThread "MainThread"' in done.stdout
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_pid_that_does_not_exist() -> None:
    done = stacks("--pid", "999999")  # above the default pid_max: never a process
    assert done.returncode == 1
    assert (
        "stacks not read: no process 999999 (it ended, or it lives in another PID namespace)"
        in (done.stdout)
    )


def test_a_process_that_is_not_python() -> None:
    proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        done = stacks("--pid", str(proc.pid))
        assert done.returncode == 1
        assert f"pid {proc.pid}: stacks not read: process {proc.pid} is not a Python process" in (
            done.stdout
        )
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv")
def test_a_process_of_another_user_names_the_cause() -> None:
    """As uid 65534 with no capability, root's process is out of reach: the line says why."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = stacks("--pid", str(proc.pid), user="65534")
        assert done.returncode == 1, done.stderr
        assert (
            f"ptrace of process {proc.pid} refused: it belongs to uid 0 and this is uid 65534 "
            "without CAP_SYS_PTRACE: run as uid 0 or as root"
        ) in done.stdout
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_an_mpirun_style_parent_and_a_plain_shell(tmp_path: Path) -> None:
    """A shell that starts two Python programs: with mpirun's OMPI_COMM_WORLD_* they are
    ranks; without, the shell's Python children are read by PID."""
    (tmp_path / "w.py").write_text("import time\ndef work():\n    time.sleep(60)\nwork()\n")
    ranked = " & ".join(
        f"OMPI_COMM_WORLD_RANK={r} OMPI_COMM_WORLD_SIZE=2 {sys.executable} w.py" for r in (0, 1)
    )
    plain = f"{sys.executable} w.py & {sys.executable} w.py"
    for script, expect in ((ranked, [(0, 2), (1, 2)]), (plain, [(None, None), (None, None)])):
        shell = subprocess.Popen(
            ["sh", "-c", f"{script} & wait"],
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the shell and its programs: one group to kill
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                doc = report("--pid", str(shell.pid))
                if len(doc["processes"]) == 2 and all(p["threads"] for p in doc["processes"]):
                    break
                assert time.monotonic() < deadline, doc
                time.sleep(0.5)
            assert [(p["rank"], p["world_size"]) for p in doc["processes"]] == expect
            assert {p["frame"] for p in doc["processes"]} == {"w.py:3 in work"}
            assert doc["culprit"] == [] and doc["why"] == "no rank waits in a collective"
        finally:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=10)
