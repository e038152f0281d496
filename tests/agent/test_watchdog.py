"""The stall watchdog: stacks, an event, and a remote look at the stuck frame."""

from __future__ import annotations

import re
import threading
import time

import pytest

from breakpod._core import events
from breakpod._job import boundary, watchdog
from tests.agent.test_job_timeouts import probe

STUCK = """
    import time, breakpod
    breakpod.watch_stalls(0.5, action="inspect")
    for step in range(3):
        breakpod.heartbeat(step)
        time.sleep(0.05)

    def all_reduce(bucket):
        time.sleep(60)  # stands in for a collective that never completes

    all_reduce(bucket=[1.0, 2.0])
"""


def test_stall_prints_stacks_and_opens_an_inspection(spawn, pdb_client):
    child = spawn(STUCK)
    child.wait_for(r"stall: no heartbeat for \d+s \(last step 2\)")
    child.wait_for(r"in all_reduce")
    client = pdb_client(child.park_port())
    banner = client.read_until()
    assert re.search(r"stall at step 2: main thread at \S+:\d+ in all_reduce\(\)", banner)
    assert client.command("p bucket").strip() == "[1.0, 2.0]"
    client.send("c")
    assert "detached" in client.read_all()
    assert child.proc.poll() is None  # inspection never ends the job


@pytest.fixture
def collected():
    seen: list[events.Event] = []
    events.add_sink(seen.append)
    yield seen
    events.remove_sink(seen.append)
    if boundary._active is not None:
        boundary._active.stop()
        boundary._active = None


def test_stall_then_recovery_emit_stall_and_resumed(collected):
    dog = boundary.watch_stalls(0.2)
    boundary.heartbeat(7)
    deadline = time.monotonic() + 5
    while not any(e.kind == "stall" for e in collected) and time.monotonic() < deadline:
        time.sleep(0.02)
    stall = next(e for e in collected if e.kind == "stall")
    assert stall.fields["step"] == 7 and 'Thread "MainThread"' in stall.fields["stacks"]
    boundary.heartbeat(8)
    assert collected[-1].kind == "resumed" and dog.stalls == 1


def test_no_watchdog_means_no_thread_and_a_free_heartbeat(monkeypatch):
    monkeypatch.setattr(boundary, "_active", None)
    before = threading.active_count()
    boundary.heartbeat(1)
    assert threading.active_count() == before


@pytest.mark.parametrize(("timeout", "action"), [(0, "dump"), (1, "reboot")])
def test_bad_arguments_are_clear(timeout, action):
    with pytest.raises(ValueError, match="stall"):
        watchdog.Watchdog(timeout, action)


def test_a_parked_process_is_not_a_stalled_one(spawn):
    child = spawn(
        """
        import breakpod
        breakpod.watch_stalls(0.3)
        breakpod.heartbeat(1)
        breakpoint()  # parked for the hold time, longer than the stall timeout
        breakpod.heartbeat(2)
        print("done", flush=True)
        """,
        env={"BREAKPOD_HOLD_SECONDS": "1.5"},
    )
    assert child.wait() == 0
    assert "nobody attached within 1.5s" in child.stderr
    assert "stall:" not in child.stderr


ENDS_WITH_A_BOARD = """
import atexit, datetime, json, os, threading
from torch.distributed import TCPStore
port = int(os.environ["MASTER_PORT"])
store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))
threads = []
def report():  # registered first, so it runs after breakpod's own exit handler
    print(json.dumps({"alive": [t.is_alive() for t in threads]}), flush=True)
atexit.register(report)
import breakpod
dog = breakpod.watch_stalls(30)
threads.append(dog._thread)
while dog.board is None:  # its ticks now talk to the job store
    threading.Event().wait(0.05)
"""


def test_the_watchdog_thread_has_ended_before_the_interpreter_finalizes():
    """A tick inside the store's C++ client when finalization starts aborts the process
    (SIGABRT after a clean run); breakpod's exit handler stops and joins the thread."""
    found = probe(ENDS_WITH_A_BOARD, ENABLE_REMOTE_DEBUG="1", RANK="1", WORLD_SIZE="2")
    assert found == {"alive": [False], "stderr": ""}
