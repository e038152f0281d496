"""``breakpod attach --pid``: a process started without breakpod parks where it was and
a client attaches. ``sys.remote_exec`` needs Python 3.14, which these machines lack;
the stand-in below does what it does, in the job: at a safe point of the job's main
thread, the script at the given path runs in a fresh namespace, called from the
interrupted frame. Everything else (the script, the listener, the park, the answer
file, the client) is real. The last test uses the real ``sys.remote_exec`` where one
exists."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from breakpod._cli import remote_exec
from breakpod._core import net

pytestmark = pytest.mark.timeout(60)

# A job that never imported breakpod; it runs what arrives at PICKUP at its next safe point.
JOB = """
import os, sys, time
PICKUP = sys.argv[1]
if len(sys.argv) > 2:
    sys.modules["breakpod"] = None  # a job whose environment lacks breakpod
def train_step(i):
    return (i * 3 + 1) % 1000
i = 0
print("ready", flush=True)
while True:
    i = train_step(i)
    if os.path.exists(PICKUP):
        path = open(PICKUP).read()
        os.unlink(PICKUP)
        exec(compile(open(path).read(), path, "exec"), {})  # what sys.remote_exec runs
        print("resumed", i, flush=True)
    time.sleep(0.01)
"""


def stand_in(pickup: Path) -> Callable[[int, str], None]:
    def inject(pid: int, path: str) -> None:
        pickup.write_text(path)

    return inject


def test_a_job_without_breakpod_parks_where_it_was_and_continues(
    spawn, pdb_client, tmp_path: Path
) -> None:
    pickup = tmp_path / "pickup"
    job = spawn(JOB, args=[str(pickup)], breakpod=False)
    assert job.proc.stdout.readline() == b"ready\n"
    address = remote_exec.park_pid(job.proc.pid, timeout=20, inject=stand_in(pickup))
    host, port = net.parse_address(address)
    assert host == "127.0.0.1"
    client = pdb_client(port)
    where = client.read_until()
    assert "child0.py" in where and "resumed" in where  # stopped at the job's next line
    assert client.command("p train_step(1)").strip() == "4"
    client.send("c")
    assert job.proc.stdout.readline().startswith(b"resumed ")
    assert not list(Path("/tmp").glob(f"breakpod-attach-{job.proc.pid}-*"))  # cleaned up
    assert job.proc.poll() is None


def test_a_job_that_cannot_import_breakpod_is_one_line(spawn, tmp_path: Path) -> None:
    pickup = tmp_path / "pickup"
    job = spawn(JOB, args=[str(pickup), "no-breakpod"], breakpod=False)
    assert job.proc.stdout.readline() == b"ready\n"
    with pytest.raises(remote_exec.AttachError) as caught:
        remote_exec.park_pid(job.proc.pid, timeout=20, inject=stand_in(pickup))
    assert str(caught.value).startswith(
        f"attach --pid {job.proc.pid}: breakpod could not start in the process (ModuleNotFoundError"
    )
    assert str(caught.value).endswith("install breakpod into the job's environment")
    assert job.proc.stdout.readline().startswith(b"resumed ")  # the job went on


def test_a_job_that_reaches_no_safe_point_names_stacks(spawn, tmp_path: Path) -> None:
    job = spawn("import time\nprint('ready', flush=True)\ntime.sleep(60)\n", breakpod=False)
    assert job.proc.stdout.readline() == b"ready\n"
    with pytest.raises(remote_exec.AttachError) as caught:
        remote_exec.park_pid(job.proc.pid, timeout=1, inject=stand_in(tmp_path / "never"))
    assert "reached no safe point in 1s" in str(caught.value)
    assert str(caught.value).endswith(f"`breakpod stacks --pid {job.proc.pid}`")


def test_a_refused_injection_is_one_line(spawn) -> None:
    job = spawn("import time\ntime.sleep(60)\n", breakpod=False)

    def refuse(pid: int, path: str) -> None:  # what sys.remote_exec raises for a 3.13 job
        raise RuntimeError("Failed to find the PyRuntime section in process")

    with pytest.raises(remote_exec.AttachError, match=r"sys\.remote_exec refused"):
        remote_exec.park_pid(job.proc.pid, timeout=5, inject=refuse)


def test_no_such_process() -> None:
    with pytest.raises(remote_exec.AttachError, match="no such process"):
        remote_exec.park_pid(2**22 + 7, timeout=1, inject=lambda pid, path: None)


@pytest.mark.skipif(
    sys.version_info < (3, 14),
    reason="no Python 3.14 on these machines: the real sys.remote_exec cannot run here",
)
def test_the_real_remote_exec_parks_a_3_14_job(spawn, pdb_client) -> None:
    job = spawn(
        "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.01)\n",
        breakpod=False,
    )
    assert job.proc.stdout.readline() == b"ready\n"
    _, port = net.parse_address(remote_exec.park_pid(job.proc.pid, timeout=20))
    client = pdb_client(port)
    client.read_until()
    client.send("c")
    assert job.proc.poll() is None
