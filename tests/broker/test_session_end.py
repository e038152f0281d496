"""Sessions end with what happened: exit status, SIGTERM while parked, late events,
and command long-polls that end cleanly when the broker shuts down. ``finished``,
``failed`` and ``killed`` are final: no stale event or heartbeat reopens a session,
and the first word on how the process ended is kept."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.broker.test_flow import SCRIPT, agent_env, kinds, only_session
from tests.brokerkit import AGENT, VIEWER, post_events, register, wait_until
from tests.conftest import PdbClient

EXITS_3 = """
    import sys
    from breakpod._link import emitter
    emitter.ensure_started()
    sys.exit(3)
"""


def test_sigterm_while_parked_is_recorded_as_killed_by_signal_15(broker, spawn):
    child = spawn(SCRIPT, env=agent_env(broker), stdin="closed")
    child.park_port()
    session = wait_until(lambda: only_session(broker, "parked"), timeout=20)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == -signal.SIGTERM  # it still dies of the signal (143 in a shell)
    killed = wait_until(lambda: only_session(broker, "killed"), timeout=20)
    assert killed["id"] == session["id"]
    assert killed["reason"] == "signal 15 (SIGTERM)"


def test_a_non_zero_exit_status_is_recorded_as_failed(broker, spawn):
    child = spawn(EXITS_3, env=agent_env(broker), stdin="closed")
    assert child.wait() == 3, child.stderr
    failed = wait_until(lambda: only_session(broker, "failed"), timeout=20)
    assert failed["reason"] == "exit 3"


def test_a_program_s_own_sigterm_handler_is_left_alone(broker, spawn):
    child = spawn(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        from breakpod._link import emitter
        emitter.ensure_started()
        print("ready", flush=True)
        for _ in range(300):  # short sleeps: a signal just before a long one waits it out
            time.sleep(0.1)
        """,
        env=agent_env(broker),
        stdin="closed",
    )
    wait_until(lambda: only_session(broker), timeout=20)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == 7
    failed = wait_until(lambda: only_session(broker, "failed"), timeout=20)
    assert failed["reason"] == "exit 7"


HUNG_IN_C = """
    import datetime, os, sys
    import torch.distributed as dist
    from breakpod._link import emitter
    emitter.ensure_started()
    # a wait in C++ that retries after a signal, as a hung collective's does
    store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 1, True,
                          timeout=datetime.timedelta(seconds=90))
    print("hung", file=sys.stderr, flush=True)
    store.wait(["never set"])
"""


def test_sigterm_ends_a_process_hung_in_a_c_call_at_once_and_is_recorded(broker, spawn):
    """Python runs a SIGTERM handler only when the main thread is back in bytecode: hung
    in a C++ wait, the process ignored SIGTERM until the wait timed out (40 s in a try;
    a collective's timeout is 30 min), where without breakpod it dies at once. The
    agent hears the signal through the wakeup pipe and ends it from its own thread."""
    child = spawn(HUNG_IN_C, env=agent_env(broker, STORE_PORT=str(free_port())), stdin="closed")
    child.wait_for("hung", timeout=60)
    wait_until(lambda: only_session(broker), timeout=20)
    sent = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait(timeout=15) == -signal.SIGTERM, child.stderr
    assert time.monotonic() - sent < 10  # the report's 3 s at most, not the wait's 90 s
    killed = wait_until(lambda: only_session(broker, "killed"), timeout=20)
    assert killed["reason"] == "signal 15 (SIGTERM)"


def test_a_second_sigterm_during_the_report_does_not_hang_the_first(spawn):
    """The report waits up to 3 s (here for a broker that takes the connection and never
    answers); a second SIGTERM meanwhile runs the handler again inside the first one's
    wait, where waiting for the first to finish would hang both."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections wait in the backlog: never accepted, never answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    child = spawn(
        """
        import sys, time
        from breakpod._link import emitter
        emitter.ensure_started()
        print("ready", file=sys.stderr, flush=True)
        for _ in range(600):
            time.sleep(0.1)
        """,
        env={"BREAKPOD_BROKER_URL": url, "BREAKPOD_AGENT_TOKEN": AGENT},
        stdin="closed",
    )
    with silent:
        child.wait_for("ready", timeout=60)
        child.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        child.proc.send_signal(signal.SIGTERM)
        assert child.wait(timeout=15) == -signal.SIGTERM, child.stderr


def test_a_sigterm_handler_the_program_sets_after_breakpod_is_the_one_that_runs(broker, spawn):
    """A program that installs its own SIGTERM handler later (to checkpoint, then exit) is
    not ended by the agent's wakeup reader before its handler gets to run."""
    child = spawn(
        """
        import signal, sys, time
        from breakpod._link import emitter
        emitter.ensure_started()
        def checkpoint_then_exit(*_):
            time.sleep(2)  # saving a checkpoint
            sys.exit(7)

        signal.signal(signal.SIGTERM, checkpoint_then_exit)
        print("ready", file=sys.stderr, flush=True)
        for _ in range(300):
            time.sleep(0.1)
        """,
        env=agent_env(broker),
        stdin="closed",
    )
    child.wait_for("ready", timeout=60)
    wait_until(lambda: only_session(broker), timeout=20)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == 7, child.stderr
    failed = wait_until(lambda: only_session(broker, "failed"), timeout=20)
    assert failed["reason"] == "exit 7"


def test_a_forked_child_s_sigterm_leaves_its_parent_running(broker, spawn):
    """A forked child (a DataLoader worker) shares its parent's wakeup pipe unless it drops
    it: its SIGTERM must end the child only."""
    child = spawn(
        """
        import os, signal, time
        from breakpod._link import emitter
        emitter.ensure_started()
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        time.sleep(2)  # the parent's reader would have ended it by now
        print("child", os.waitstatus_to_exitcode(status), "parent alive", flush=True)
        """,
        env=agent_env(broker),
        stdin="closed",
    )
    assert child.wait() == 0, child.stderr
    assert "child -15 parent alive" in child.stdout()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_late_final_event_still_closes_a_session_that_read_as_lost(start_broker):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="1")
    register(broker, "s1")
    post_events(broker, {"id": "p", "session": "s1", "kind": "parked"})
    wait_until(lambda: only_session(broker, "lost"), timeout=10)
    late = {"id": "f", "session": "s1", "kind": "finished", "fields": {"signal": 15}}
    assert post_events(broker, late).status_code == 200
    assert only_session(broker)["state"] == "killed"
    assert only_session(broker)["reason"] == "signal 15 (SIGTERM)"


def test_a_command_long_poll_ends_with_503_when_the_broker_shuts_down(start_broker):
    broker = start_broker()
    register(broker, "s1")
    answers: list[httpx.Response] = []

    def poll() -> None:
        with broker.client(AGENT) as c:
            answers.append(c.get("/v1/sessions/s1/commands", params={"wait": 25}, timeout=30))

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(1.0)  # the poll is waiting now (a late one would get 503 or no answer)
    started = time.monotonic()
    broker.proc.send_signal(signal.SIGTERM)
    thread.join(20)
    assert answers and answers[0].status_code == 503, answers
    assert "shutting down" in answers[0].json()["detail"]
    assert time.monotonic() - started < 2.5  # at once, not after the graceful timeout
    broker.proc.wait(10)
    log = broker.log_path.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log
    with httpx.Client() as c:  # and nothing answers any more
        try:
            c.get(f"{broker.url}/healthz", timeout=2)
            raise AssertionError("the broker still answers")
        except httpx.HTTPError:
            pass


STALE = [  # what an earlier, delayed batch of the same process could carry
    {"kind": "parked", "fields": {"address": "127.0.0.1:5678", "backend": "pdb"}},
    {"kind": "attached", "fields": {}},
    {"kind": "resumed", "fields": {}},
    {"kind": "stall", "fields": {"reason": "no step for 60s"}},
]


def test_a_stale_event_after_finished_never_reopens_the_session(broker):
    register(broker, "s1")
    final = {"id": "f", "session": "s1", "kind": "finished", "fields": {"signal": 15}}
    assert post_events(broker, final).json()["accepted"] == 1
    for n, stale in enumerate(STALE):
        reply = post_events(broker, {"id": f"late{n}", "session": "s1", **stale})
        assert reply.status_code == 200 and reply.json()["accepted"] == 1, reply.text  # stored
        session = only_session(broker)
        assert session["state"] == "killed", (stale, session)
        assert session["reason"] == "signal 15 (SIGTERM)", (stale, session)
        assert session.get("address") is None, (stale, session)
    assert kinds(broker, "s1").count("parked") == 1  # the history keeps them all


def test_a_later_final_event_still_tells_how_it_ended(broker):
    """An anomaly's expired hold says finished first; the exit status follows."""
    register(broker, "s1")
    said = {"id": "a", "session": "s1", "kind": "finished", "fields": {"why": "hold expired"}}
    post_events(broker, said)
    assert only_session(broker)["reason"] == "hold expired"
    post_events(broker, {"id": "r", "session": "s1", "kind": "resumed"})
    post_events(broker, {"id": "x", "session": "s1", "kind": "finished", "fields": {"exit": 3}})
    assert only_session(broker)["state"] == "failed"
    assert only_session(broker)["reason"] == "exit 3"


def test_the_first_exit_status_settles_how_a_session_ended(broker):
    """A rank fails (exit 1); its launcher then sends it SIGTERM while it exits, and the
    agent reports that too. The first status is the cause: the session stays failed."""
    register(broker, "s1")
    failed = {"id": "a", "session": "s1", "kind": "finished", "fields": {"exit": 1}}
    echo = {"id": "b", "session": "s1", "kind": "finished", "fields": {"signal": 15}}
    assert post_events(broker, failed, echo).json()["accepted"] == 2
    session = only_session(broker)
    assert (session["state"], session["reason"]) == ("failed", "exit 1")
    post_events(broker, {"id": "c", "session": "s1", "kind": "killed", "fields": {"exit": 137}})
    assert (only_session(broker)["state"], only_session(broker)["reason"]) == ("failed", "exit 1")
    assert kinds(broker, "s1") == ["finished", "finished", "killed"]  # all kept as history


def test_a_clean_exit_is_finished_and_a_runtime_kill_is_killed_with_its_reason(broker):
    register(broker, "ok")
    register(broker, "oom")
    post_events(broker, {"id": "f", "session": "ok", "kind": "finished", "fields": {"exit": 0}})
    oom = {"reason": "OOMKilled", "exit": 137, "source": "docker"}
    post_events(broker, {"id": "k", "session": "oom", "kind": "killed", "fields": oom})
    with broker.client(VIEWER) as c:
        found = {s["id"]: s for s in c.get("/v1/sessions").json()["sessions"]}
    assert (found["ok"]["state"], found["ok"]["reason"]) == ("finished", "exit 0")
    assert (found["oom"]["state"], found["oom"]["reason"]) == ("killed", "OOMKilled (exit 137)")


def test_finished_stays_final_within_one_batch(broker):
    register(broker, "s1")
    batch = [
        {"id": "p", "session": "s1", "kind": "parked"},
        {"id": "f", "session": "s1", "kind": "finished", "fields": {"exit": 3}},
        {"id": "r", "session": "s1", "kind": "resumed"},
        {"id": "l", "session": "s1", "kind": "listening", "fields": {"address": "0.0.0.0:1"}},
    ]
    assert post_events(broker, *batch).json()["accepted"] == 4
    assert only_session(broker)["state"] == "failed"
    assert only_session(broker)["reason"] == "exit 3"
    assert only_session(broker)["address"] is None


def test_a_stale_heartbeat_after_finished_keeps_it_finished(broker):
    register(broker, "s1")
    post_events(broker, {"id": "f", "session": "s1", "kind": "finished", "fields": {"exit": 0}})
    before = only_session(broker)["last_seen"]
    with broker.client(AGENT) as c:
        reply = c.post("/v1/sessions/s1/heartbeat", json={"state": "running", "reason": "again"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "finished" and reply.json()["reason"] == "exit 0"
    session = only_session(broker)
    assert session["state"] == "finished" and session["reason"] == "exit 0"
    assert session["last_seen"] >= before  # the heartbeat itself still counts


def test_a_heartbeat_still_changes_the_state_of_a_live_session(broker):
    """The other side of the rule: only the final states are sticky."""
    register(broker, "s1")
    with broker.client(AGENT) as c:
        reply = c.post("/v1/sessions/s1/heartbeat", json={"state": "stalled", "reason": "slow"})
    assert reply.json()["state"] == "stalled"


WAITS_FOR_GO = """
    import os, sys, time
    x = 41
    breakpoint()
    while not os.path.exists({go!r}):
        time.sleep(0.05)
    sys.exit(3)
"""


def test_events_queued_during_an_outage_arrive_late_and_close_the_session(
    start_broker, spawn, tmp_path: Path
):
    """A real agent parks; the broker goes away; the engineer continues over the
    socket meanwhile; the broker returns on its port (same Redis) and reads the
    session as lost; the queued events arrive, and the exit closes the session."""
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="2")
    go = tmp_path / "go"
    child = spawn(WAITS_FOR_GO.format(go=str(go)), env=agent_env(broker), stdin="closed")
    port = child.park_port()
    session = wait_until(lambda: only_session(broker, "parked"), timeout=20)
    broker.stop()

    client = PdbClient(port)  # the listener needs no broker
    try:
        client.read_until()
        client.send("c")
        client.read_all()
    finally:
        client.close()
    broker.start()  # same port, same Redis: the agent's sender finds it again
    wait_until(lambda: "resumed" in kinds(broker, session["id"]), timeout=20)  # late
    wait_until(lambda: only_session(broker, "lost"), timeout=20)  # no heartbeat for 2s

    go.touch()
    assert child.wait() == 3
    failed = wait_until(lambda: only_session(broker, "failed"), timeout=20)
    assert failed["reason"] == "exit 3"
    post_events(broker, {"id": "stale", "session": session["id"], "kind": "parked"})
    assert only_session(broker)["state"] == "failed"
