"""A ``break`` that reaches a rank before its watchdog first reached the job's store
(as a job starts) is queued, not dropped: the watchdog proposes the job-wide break once
connected, or parks this rank alone when the store is unreachable (a real torch store,
one rank of two in a child process)."""

from __future__ import annotations

import os
import re

import pytest

from tests.agent.test_job_timeouts import probe

EARLY_BREAK = """
import datetime, json, os, sys, time
import torch
from torch.distributed import TCPStore
from breakpod._link import commands
from breakpod._core import events, holding
from breakpod._job import board, boundary
board.CONNECT_SECONDS = 1.0  # an unreachable store fails fast (a loaded machine: 20 s to spare)
store = None
if os.environ.get("SERVE_STORE"):
    port = int(os.environ["MASTER_PORT"])
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=5))
if os.environ.get("BREAK_FIRST"):
    ok, reply = commands.do_break()  # before the process group started the watchdog
dog = boundary.watch_stalls(60.0, after_first_step=True)  # as init_process_group starts it
if not os.environ.get("BREAK_FIRST"):
    ok, reply = commands.do_break()  # before the watchdog thread's first tick
holding.hold()  # a park before the store was tried: published once connected, or alone
boundary.note_park("breakpoint() at here", sys._getframe())
deadline = time.monotonic() + 20
while dog.pause.break_at is None and not events._break_requested and time.monotonic() < deadline:
    time.sleep(0.05)
proposed = store.get("breakpod/job/0/break").decode() if store is not None else None
print(json.dumps({
    "reply": reply, "break_at": dog.pause.break_at, "proposed": proposed,
    "alone": events.pending_break(), "missing": dog.job_view_missing,
}))
dog.stop(wait=10)
"""

DISTRIBUTED_DEBUG = {"ENABLE_REMOTE_DEBUG": "1", "RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    "break_first", [False, True], ids=["before-the-first-tick", "before-the-watchdog-started"]
)
def test_a_break_before_the_first_connection_becomes_a_job_wide_break(break_first: bool):
    env = {"BREAK_FIRST": "1"} if break_first else {}
    found = probe(EARLY_BREAK, SERVE_STORE="1", **DISTRIBUTED_DEBUG, **env)
    said = str(found["reply"])
    assert said.startswith("the job parks at a step boundary every rank agrees on"), said
    if break_first:  # no watchdog yet: it says it waits for the ranks to connect
        assert said.endswith(", once its ranks connect"), said
    assert found["missing"] is None and found["break_at"] == 1  # no step yet: the next one
    assert '"step": 1' in str(found["proposed"])
    assert found["alone"] is False  # no local break besides the job's
    assert "parks alone" not in str(found["stderr"])


def test_a_break_queued_for_an_unreachable_store_parks_this_rank_alone():
    found = probe(EARLY_BREAK, **DISTRIBUTED_DEBUG)  # nothing listens on MASTER_PORT
    assert found["break_at"] is None and "cannot reach the job store" in str(found["missing"])
    assert found["alone"] is True  # the next step boundary parks
    stderr = str(found["stderr"])
    assert "break: this rank parks alone; the job was not paused (cannot reach" in stderr
    # the park that began before the store was tried is told too, once
    assert stderr.count("this rank parks alone: the job was not paused (cannot reach") == 1


JOB_BREAK_AT_A_BOUNDARY = """
    import datetime, os, socket
    import torch
    from torch.distributed import TCPStore
    import breakpod
    from breakpod._link import commands
    from breakpod._core import events
    from breakpod._job import boundary
    from tests.agent.nets import Net, batch

    BOUNDARY = os.environ["BOUNDARY"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,
                     wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    boundary.watch_stalls(60.0, after_first_step=True)
    commands.do_break()  # the job-wide break lands at the first step boundary
    events.request_break()  # and a local one (a later `break` after the store was lost)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if BOUNDARY in ("optimizer", "monitor.step()"):
        monitor = breakpod.watch(model, optimizer=optimizer if BOUNDARY == "optimizer" else None)
    for step in range(40):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the boundary with optimizer=
        if BOUNDARY == "monitor.step()":
            monitor.step()
        elif BOUNDARY == "breakpod.step()":
            breakpod.step()
        elif BOUNDARY == "break_if_requested()":
            breakpod.break_if_requested()
    print("finished", step)
"""


@pytest.mark.parametrize(
    "boundary", ["optimizer", "monitor.step()", "breakpod.step()", "break_if_requested()"]
)
def test_a_job_wide_break_parks_once_and_stops_in_the_training_loop(
    spawn, pdb_client, boundary: str
):
    """Nothing between the park and the loop's next line may run code the debugger does
    not skip (the first stops were threading.py's ``Event.is_set``, the local-break check
    after a boundary, and, inside the optimizer's step, torch's ``typing.cast``); a local
    break pending at the same boundary is served by the same park, not a second one."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    path = os.pathsep.join([os.path.join(root, "agent", "src"), root])
    env = {"PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "BOUNDARY": boundary}
    child = spawn(JOB_BREAK_AT_A_BOUNDARY, env={**env, **DISTRIBUTED_DEBUG})
    client = pdb_client(child.park_port(timeout=60))
    banner = client.read_until()
    assert "job-wide break at step 1" in banner
    here = r"child\d+\.py\(\d+\)<module>\(\)\n-> "
    line = "optimizer.step()" if boundary == "optimizer" else "for step in range(40):"
    assert re.search(here + re.escape(line), banner), banner
    assert client.command("p step").strip() == "0"
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 0 and "finished 39" in child.stdout()
    assert child.stderr.count("waiting") == 1  # one park
