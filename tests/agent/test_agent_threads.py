"""The agent's threads block the signals a job handles, so that a SIGTERM or a Ctrl-C
sent to the process always lands on one of the job's own threads (see
breakpod._core.threads). Read from the kernel: each thread's SigBlk in /proc."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from breakpod._core.threads import JOB_SIGNALS

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")

AGENT = """
    import json, threading, time
    import breakpod
    from breakpod._link import emitter

    breakpod.init_remote_debugger(port=0, backend="pdb", enable=True)  # the listener
    breakpod.watch_stalls(600)  # the watchdog
    emitter.ensure_started()  # its send and poll loops (the broker need not answer)
    masks = {}
    for thread in threading.enumerate():
        with open(f"/proc/self/task/{thread.native_id}/status") as status:
            line = next(line for line in status if line.startswith("SigBlk:"))
        masks[thread.name] = int(line.split()[1], 16)
    print(json.dumps(masks), flush=True)
"""


def blocked(mask: int) -> set[int]:
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_agents_threads_block_the_jobs_signals_and_the_main_thread_does_not(spawn):
    child = spawn(AGENT, env={"BREAKPOD_BROKER_URL": "http://127.0.0.1:9"}, stdin="closed")
    assert child.wait() == 0, child.stderr
    masks = json.loads(child.stdout())
    agent = {name for name in masks if name.startswith("breakpod")}
    assert {"breakpod-listener", "breakpod-watchdog", "breakpod_send_loop"} <= agent, masks
    for name in agent:
        assert set(JOB_SIGNALS) <= blocked(masks[name]), (name, blocked(masks[name]))
    assert not blocked(masks["MainThread"]) & set(JOB_SIGNALS)
    assert {signal.SIGINT, signal.SIGTERM} <= set(JOB_SIGNALS)
