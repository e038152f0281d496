"""`breakpod attach` recognises what answers: a debugpy listener gets its launch.json and a
non-zero exit within 2 s, a busy or silent listener a clear refusal, a finished session
no launch.json; `--vscode` through the broker maps onto the job's working directory."""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import pytest

from breakpod._cli import attach
from breakpod._core.errors import AttachError
from tests.agent.test_attach_cli import run_cli
from tests.agent.test_breakpoint import SCRIPT
from tests.brokerkit import AGENT, VIEWER, wait_until
from tests.dap import continue_parked

pytest.importorskip("debugpy")

DEBUGPY_JOB = """
    import breakpod
    breakpod.init_remote_debugger(port=0, backend="debugpy", enable=True)
    x = 41
    breakpoint()
    print("finished", x + 1, flush=True)
"""
DEBUGPY_PORT = r"debugpy listening on 127\.0\.0\.1:(\d+)"


def test_attach_to_a_debugpy_listener_prints_a_launch_json_and_fails(spawn):
    child = spawn(DEBUGPY_JOB, stdin="closed")
    port = int(child.wait_for(DEBUGPY_PORT).group(1))
    result = run_cli("attach", f"127.0.0.1:{port}", timeout=30)
    assert result.returncode == 2, result.stderr
    assert "is a debugpy (DAP) listener, not a remote pdb" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line, no raw DAP
    assert "Content-Length" not in result.stdout + result.stderr
    launch = json.loads(result.stdout)
    assert launch["configurations"][0]["connect"] == {"host": "127.0.0.1", "port": port}
    # the job is still parked: a real DAP client attaches after the probe and continues it
    continue_parked(port)
    assert child.wait(timeout=30) == 0
    assert "finished 42" in child.stdout()


def test_the_dap_verdict_comes_within_two_seconds(spawn):
    child = spawn(DEBUGPY_JOB, stdin="closed")
    port = int(child.wait_for(DEBUGPY_PORT).group(1))
    out = io.StringIO()
    started = time.monotonic()
    with pytest.raises(AttachError, match="debugpy"):
        attach.attach("127.0.0.1", port, out=out, remote_root="/app")
    assert time.monotonic() - started < 2.0
    launch = json.loads(out.getvalue())
    assert launch["configurations"][0]["pathMappings"][0]["remoteRoot"] == "/app"


def test_probing_a_debugpy_listener_again_and_again_leaves_it_open_to_an_ide(spawn):
    """debugpy's adapter stops accepting clients when one hangs up in the middle of its
    greeting; each probe hears the greeting out, so the IDE that comes next attaches."""
    child = spawn(DEBUGPY_JOB, stdin="closed")
    port = int(child.wait_for(DEBUGPY_PORT).group(1))
    for _ in range(12):  # an engineer running `breakpod attach` again, and again
        started = time.monotonic()
        with pytest.raises(AttachError, match="debugpy"):
            attach.attach("127.0.0.1", port, out=io.StringIO())
        assert time.monotonic() - started < 2.0
        time.sleep(0.1)  # not back to back: debugpy also jams on overlapping sessions
    continue_parked(port)
    assert child.wait(timeout=30) == 0


def test_a_listener_that_says_nothing_is_not_waited_on_forever(monkeypatch):
    monkeypatch.setattr(attach, "FIRST_WORDS_TIMEOUT", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with pytest.raises(AttachError, match=r"said nothing in 0\.5s"):
            attach.attach("127.0.0.1", port, out=io.StringIO())


def test_a_second_client_is_refused_with_a_non_zero_exit(spawn):
    child = spawn(SCRIPT, stdin="closed")
    port = child.park_port()
    first = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        first.recv(4096)  # the first client holds the session
        second = run_cli("attach", f"127.0.0.1:{port}")
        assert second.returncode != 0, second.stdout
        assert "the listener refused this client" in second.stderr
    finally:
        first.sendall(b"c\n")
        first.close()
    assert child.wait(timeout=30) == 0


def broker_env(broker):
    return {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_BROKER_TOKEN": VIEWER}


def session_of(broker, state):
    with broker.client(VIEWER) as c:
        found = c.get("/v1/sessions", params={"state": state}).json()["sessions"]
    return found[0] if found else None


def test_vscode_through_the_broker_maps_onto_the_job_s_working_directory(broker, spawn, tmp_path):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(DEBUGPY_JOB, env=env, stdin="closed")
    child.wait_for(DEBUGPY_PORT)
    session = wait_until(lambda: session_of(broker, "parked"), timeout=30)
    assert session["cwd"]  # the agent reported it at registration
    result = run_cli("attach", session["id"], "--vscode", env=broker_env(broker))
    assert result.returncode == 0, result.stderr
    mapping = json.loads(result.stdout)["configurations"][0]["pathMappings"][0]
    assert mapping["remoteRoot"] == session["cwd"]
    given = run_cli("attach", session["id"], "--remote-root", "/src", env=broker_env(broker))
    assert json.loads(given.stdout)["configurations"][0]["pathMappings"][0]["remoteRoot"] == "/src"
    child.proc.kill()


def test_attach_to_a_finished_session_fails_without_a_launch_json(broker, spawn):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(DEBUGPY_JOB, env={**env, "BREAKPOD_HOLD_SECONDS": "0"}, stdin="closed")
    assert child.wait(timeout=30) == 0
    session = wait_until(lambda: session_of(broker, "finished"), timeout=30)
    result = run_cli("attach", session["id"], env=broker_env(broker))
    assert result.returncode == 2, result.stdout
    assert result.stdout == ""
    assert f"session {session['id']} is finished" in result.stderr


def test_a_listener_that_greets_like_pdb_is_attached_as_before():
    """A plain TCP server that greets like pdb is attached normally (no false DAP verdict)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]

        def greet() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"> train.py(3)<module>()\n(Pdb) ")
                conn.recv(100)

        thread = threading.Thread(target=greet, daemon=True)
        thread.start()
        out = io.StringIO()
        attach.attach("127.0.0.1", port, out=out, read_line=lambda _prompt: "c")
        thread.join(10)
    assert "train.py(3)" in out.getvalue()
