"""The engineer's flow end to end: a real parked child, a real broker, the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.brokerkit import ADMIN, AGENT, VIEWER, register, wait_until

SCRIPT = """
    x = 41
    breakpoint()
    x += 1
    print("finished", x)
"""

LOOP = """
    import time
    import breakpod
    from breakpod._link import emitter
    from breakpod._core import events
    seen = []
    events.add_sink(lambda event: seen.append(event.kind))
    emitter.ensure_started()
    for step in range(3000):
        time.sleep(0.01)
        breakpod.{boundary}()
        if "resumed" in seen:
            break
    print("finished", seen)
"""


def cli(broker, *args, token=VIEWER, stdin="", timeout=30, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    full_env.update(BREAKPOD_BROKER_URL=broker.url, BREAKPOD_BROKER_TOKEN=token, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def agent_env(broker, **extra):
    return {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT, **extra}


def only_session(broker, state=None):
    with broker.client(VIEWER) as c:
        sessions = c.get("/v1/sessions").json()["sessions"]
    if len(sessions) == 1 and state in (None, sessions[0]["state"]):
        return sessions[0]
    return None


def kinds(broker, session_id):
    with broker.client(VIEWER) as c:
        events = c.get("/v1/events", params={"session": session_id}).json()["events"]
    return [e["kind"] for e in events]


def test_a_parked_child_is_listed_attached_by_id_then_resumed_and_finished(broker, spawn):
    child = spawn(SCRIPT, env=agent_env(broker))
    port = child.park_port()
    session = wait_until(lambda: only_session(broker, "parked"))
    assert session["address"] == f"127.0.0.1:{port}" and session["pid"] == child.proc.pid

    listing = cli(broker, "sessions")
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith(session["id"]))
    assert "parked" in row and "breakpoint() at" in row

    attached = cli(broker, "attach", session["id"], stdin="p x\nc\n")
    assert attached.returncode == 0, attached.stderr
    assert "(Pdb) p x\n41" in attached.stdout and "-> x += 1" in attached.stdout
    assert child.wait() == 0 and "finished 42" in child.stdout()
    wait_until(lambda: only_session(broker, "finished"))
    assert kinds(broker, session["id"]) == ["parked", "attached", "detached", "resumed", "finished"]
    events = cli(broker, "events", "--session", session["id"], "--kind", "resumed")
    assert events.stdout.count("resumed") == 1


def test_resume_and_dump_stacks_reach_a_parked_child_through_the_broker(broker, spawn):
    child = spawn(SCRIPT, env=agent_env(broker))
    child.park_port()
    session_id = wait_until(lambda: only_session(broker, "parked"))["id"]
    sent = cli(broker, "send", session_id, "dump-stacks", token=ADMIN)
    assert sent.returncode == 0 and "queued dump-stacks" in sent.stdout
    stacks = wait_until(lambda: _log_events(broker, session_id))
    assert "breakpoint()" in stacks[0]["fields"]["stacks"]
    assert cli(broker, "send", session_id, "resume", token=ADMIN).returncode == 0
    assert child.wait() == 0 and "finished 42" in child.stdout()
    assert "resume command; continuing" in child.stderr
    wait_until(lambda: only_session(broker, "finished"))


def _log_events(broker, session_id):
    with broker.client(VIEWER) as c:
        events = c.get("/v1/events", params={"session": session_id, "kind": "log"}).json()
    return events["events"]


@pytest.mark.parametrize("boundary", ["break_if_requested", "step"])
def test_break_parks_a_running_loop_at_its_next_step_boundary(broker, spawn, boundary):
    """A loop's own boundary (as the monitors' step() has), or ``breakpod.step()`` with
    neither stall detection nor debug mode on: its first call disarmed it."""
    child = spawn(LOOP.format(boundary=boundary), env=agent_env(broker))
    session_id = wait_until(lambda: only_session(broker, "running"))["id"]
    assert cli(broker, "send", session_id, "break", token=ADMIN).returncode == 0
    child.wait_for("break requested through the broker")
    wait_until(lambda: only_session(broker, "parked"))
    assert cli(broker, "send", session_id, "resume", token=ADMIN).returncode == 0
    assert child.wait() == 0 and "finished ['parked', 'resumed']" in child.stdout()


STAND_IN_KUBECTL = """\
    #!{python}
    # A stand-in for kubectl port-forward: no Kubernetes API server can run on
    # these machines. It parses the same arguments, prints kubectl's line, and
    # relays 127.0.0.1:LOCAL to the pod's port (here: the child on this host).
    import socket, sys, threading
    args = sys.argv[1:]
    assert args[0] == "port-forward" and args[1] == "-n" and args[3].startswith("pod/"), args
    local, remote = map(int, args[4].split(":"))
    server = socket.create_server(("127.0.0.1", local))
    print(f"Forwarding from 127.0.0.1:{{local}} -> {{remote}}", flush=True)
    conn, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", remote))
    def pipe(a, b):
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)
    threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
    pipe(conn, upstream)
"""


def test_attach_to_a_kubernetes_session_runs_port_forward_first(broker, spawn, tmp_path):
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(textwrap.dedent(STAND_IN_KUBECTL.format(python=sys.executable)))
    kubectl.chmod(0o755)
    child = spawn(SCRIPT, env=agent_env(broker, POD_NAME="train-0", POD_NAMESPACE="ml"))
    child.park_port()
    session = wait_until(lambda: only_session(broker, "parked"))
    assert session["runtime"] == "kubernetes" and session["pod"] == "train-0"
    path = f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}"
    attached = cli(broker, "attach", session["id"], stdin="p x\nc\n", env={"PATH": path})
    assert attached.returncode == 0, attached.stderr
    assert "kubectl port-forward -n ml pod/train-0" in attached.stderr
    assert "(Pdb) p x\n41" in attached.stdout
    assert child.wait() == 0


def test_vscode_flag_prints_a_launch_json_for_a_debugpy_session(broker):
    register(broker, "dbg", listener="debugpy", address="127.0.0.1:5679")
    printed = cli(broker, "attach", "dbg", "--vscode")
    assert printed.returncode == 0, printed.stderr
    config = json.loads(printed.stdout)["configurations"][0]
    assert config["connect"] == {"host": "127.0.0.1", "port": 5679}


def test_events_follow_streams_new_events(broker):
    register(broker, "s1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    cmd = [sys.executable, "-m", "breakpod._cli.main", "events", "-f", "--broker", broker.url]
    proc = subprocess.Popen([*cmd, "--token", VIEWER], stdout=subprocess.PIPE, text=True, env=env)
    stop = threading.Event()

    def post_until_seen() -> None:  # the CLI subscribes when it has started: keep posting
        with broker.client(AGENT) as c:
            for i in range(100):
                event = {"id": f"e{i}", "session": "s1", "kind": "anomaly", "fields": {"n": i}}
                c.post("/v1/events", json={"events": [event]})
                if stop.wait(0.2):
                    return

    threading.Thread(target=post_until_seen, daemon=True).start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "anomaly" in line and "s1" in line and "n=" in line
    finally:
        stop.set()
        proc.kill()
        proc.wait(5)


@pytest.mark.parametrize(
    ("url", "token", "message"),
    [
        ("http://127.0.0.1:9", VIEWER, "cannot reach the broker at http://127.0.0.1:9"),
        (None, "wrong-token-000", "refused the token"),
        (None, AGENT, "may not GET /v1/sessions"),
    ],
)
def test_cli_errors_are_readable(broker, url, token, message):
    result = cli(broker, "sessions", *(["--broker", url] if url else []), token=token)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_without_a_broker_says_how_to_set_one(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    result = subprocess.run(
        [sys.executable, "-m", "breakpod._cli.main", "sessions"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode == 2 and "BREAKPOD_BROKER_URL" in result.stderr


def test_events_follow_resumes_when_the_broker_ends_the_stream(start_broker):
    broker = start_broker(BREAKPOD_MAX_STREAM_SECONDS="1")
    register(broker, "s1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    cmd = [sys.executable, "-m", "breakpod._cli.main", "events", "-f", "--broker", broker.url]
    proc = subprocess.Popen([*cmd, "--token", VIEWER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        with broker.client(AGENT) as c:
            for i in range(2):
                time.sleep(2.5)  # longer than the stream's lifetime: the CLI reconnected
                event = {"id": f"e{i}", "session": "s1", "kind": "anomaly", "fields": {"n": i}}
                c.post("/v1/events", json={"events": [event]})
                assert f"n={i}" in proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait(5)
