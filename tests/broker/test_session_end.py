"""Sessions end with what happened: exit status, SIGTERM while parked, late events,
and command long-polls that end cleanly when the broker shuts down."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.broker.test_flow import SCRIPT, agent_env, only_session
from tests.brokerkit import AGENT, post_events, register, wait_until

EXITS_3 = """
    import sys
    from breakpod._broker import emitter
    emitter.ensure_started()
    sys.exit(3)
"""


def test_sigterm_while_parked_is_recorded_as_finished_signal_15(broker, spawn):
    child = spawn(SCRIPT, env=agent_env(broker), stdin="closed")
    child.park_port()
    session = wait_until(lambda: only_session(broker, "parked"), timeout=20)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == -signal.SIGTERM  # it still dies of the signal (143 in a shell)
    finished = wait_until(lambda: only_session(broker, "finished"), timeout=20)
    assert finished["id"] == session["id"]
    assert finished["reason"] == "finished (signal 15)"


def test_an_exit_status_is_recorded(broker, spawn):
    child = spawn(EXITS_3, env=agent_env(broker), stdin="closed")
    assert child.wait() == 3, child.stderr
    finished = wait_until(lambda: only_session(broker, "finished"), timeout=20)
    assert finished["reason"] == "finished (exit 3)"


def test_a_program_s_own_sigterm_handler_is_left_alone(broker, spawn):
    child = spawn(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        from breakpod._broker import emitter
        emitter.ensure_started()
        print("ready", flush=True)
        time.sleep(30)
        """,
        env=agent_env(broker),
        stdin="closed",
    )
    wait_until(lambda: only_session(broker), timeout=20)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == 7
    finished = wait_until(lambda: only_session(broker, "finished"), timeout=20)
    assert finished["reason"] == "finished (exit 7)"


def test_a_late_final_event_still_closes_a_session_that_read_as_lost(start_broker):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="1")
    register(broker, "s1")
    post_events(broker, {"id": "p", "session": "s1", "kind": "parked"})
    wait_until(lambda: only_session(broker, "lost"), timeout=10)
    late = {"id": "f", "session": "s1", "kind": "finished", "fields": {"signal": 15}}
    assert post_events(broker, late).status_code == 200
    assert only_session(broker)["state"] == "finished"
    assert only_session(broker)["reason"] == "finished (signal 15)"


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
