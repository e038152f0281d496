"""With a debugpy listener running, a crash's post-mortem goes to the DAP client."""

from __future__ import annotations

import pytest

from tests.dap import DapClient

pytest.importorskip("debugpy")

CRASH = """
    import breakpod
    breakpod.init_remote_debugger(port=0, backend="debugpy", enable=True)
    breakpod.install_excepthook()

    def scale(values, factor):
        scaled = [v * factor for v in values]
        return scaled[len(values)]

    scale([1, 2], 3)
"""


def test_uncaught_exception_stops_the_dap_client_in_the_failing_frame(spawn):
    child = spawn(CRASH, env={"BREAKPOD_HOLD_SECONDS": "30"})
    port = int(child.wait_for(r"waiting up to 30s for a DAP client on 127\.0\.0\.1:(\d+)").group(1))
    client = DapClient(port)
    try:
        client.handshake()
        stopped = client.wait_event("stopped")
        assert stopped["body"]["reason"] == "exception"
        thread = stopped["body"]["threadId"]
        info = client.call("exceptionInfo", threadId=thread)["body"]
        assert "IndexError" in info["exceptionId"]
        top = client.top_frame(thread)
        assert top["name"] == "scale"
        assert client.frame_locals(top["id"])["factor"] == "3"
        client.call("continue", threadId=thread)
    finally:
        client.close()
    assert child.wait(timeout=30) == 1
    assert "IndexError" in child.stderr
