"""The debugpy backend, driven by a real DAP client over the socket."""

from __future__ import annotations

import pytest

from tests.agent.test_breakpoint import FORK
from tests.dap import DapClient

pytest.importorskip("debugpy")

SCRIPT = """
    import breakpod
    endpoint = breakpod.init_remote_debugger(port=0, backend="debugpy", enable=True)
    breakpod.init_remote_debugger(port=0, backend="debugpy", enable=True)  # harmless twice
    x = 41
    breakpoint()
    x += 1
    print("finished", x, flush=True)
"""


def attach(port: int) -> DapClient:
    client = DapClient(port)
    client.handshake()
    return client


def test_dap_client_sees_main_thread_and_breakpoint_stops_in_caller(spawn):
    child = spawn(SCRIPT)
    port = int(child.wait_for(r"debugpy listening on 127\.0\.0\.1:(\d+)").group(1))
    client = attach(port)
    try:
        threads = client.call("threads")["body"]["threads"]
        assert any(t["name"] == "MainThread" for t in threads)
        stopped = client.wait_event("stopped")
        top = client.top_frame(stopped["body"]["threadId"])
        assert top["source"]["path"].endswith(".py") and top["line"] == 7  # `x += 1`
        assert client.frame_locals(top["id"])["x"] == "41"
        client.call("continue", threadId=stopped["body"]["threadId"])
    finally:
        client.close()
    assert child.wait() == 0
    assert "finished 42" in child.stdout()


def test_breakpoint_with_debugpy_and_no_client_continues_after_hold(spawn):
    child = spawn(SCRIPT, env={"BREAKPOD_HOLD_SECONDS": "1"})
    assert child.wait(timeout=30) == 0
    assert "nobody attached within 1s" in child.stderr


def test_a_hold_shorter_than_the_wait_s_start_still_ends(spawn):
    """The hold's timer can fire before debugpy's wait has begun (cancel() then raises):
    a short hold, many times over, must still end every wait."""
    child = spawn(
        """
        import breakpod
        breakpod.init_remote_debugger(port=0, backend="debugpy", enable=True)
        for _ in range(30):
            breakpoint()
        print("all 30 ended", flush=True)
        """,
        env={"BREAKPOD_HOLD_SECONDS": "0.000001"},
        stdin="closed",
    )
    assert child.wait(timeout=60) == 0
    assert "all 30 ended" in child.stdout()


# a DataLoader-style worker forked by a process with a debugpy listener; no IDE attached
FORKED = FORK.replace('backend="pdb"', 'backend="debugpy"')


def test_a_forked_worker_with_no_ide_attached_parks_on_a_pdb_listener_of_its_own(spawn, pdb_client):
    """The debugpy listener serves the parent: the worker waiting there could be
    reached by nobody."""
    child = spawn(FORKED)
    dap = child.wait_for(r"debugpy listening on 127\.0\.0\.1:(\d+)").group(1)
    port = child.park_port()
    assert str(port) != dap
    client = pdb_client(port)
    assert "-> os._exit(0)" in client.read_until()
    assert client.command("p worker").strip() == "'child'"
    client.send("c")
    assert child.wait() == 0 and "worker exited 0" in child.stdout()
