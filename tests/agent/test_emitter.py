"""The agent's emitter and identity, without a broker: cheap, contained, off by default."""

from __future__ import annotations

import json
import threading
import time

import pytest

from breakpod._core import identity
from breakpod._link import emitter
from breakpod._link.emitter import Emitter, _encode

DEAD_URL = "http://127.0.0.1:9"  # discard port: nothing listens


def test_without_a_broker_url_nothing_starts(spawn):
    child = spawn(
        """
        import sys, threading
        import breakpod
        assert "breakpod._link.emitter" not in sys.modules and "http.client" not in sys.modules
        from breakpod._link import emitter
        assert emitter.ensure_started() is None and not emitter.pending_break()
        print(threading.active_count())
        """
    )
    assert child.wait() == 0, child.stderr
    assert child.stdout().strip() == "1"


def test_a_bad_broker_url_is_announced_once_and_the_program_runs_on(spawn):
    child = spawn(
        """
        from breakpod._link import emitter
        assert emitter.ensure_started() is None and emitter.ensure_started() is None
        print("ran")
        """,
        env={"BREAKPOD_BROKER_URL": "ftp://example"},
    )
    assert child.wait() == 0 and child.stdout().strip() == "ran"
    assert child.stderr.count("not reporting to the broker") == 1


def test_emit_queues_without_blocking_and_maps_unknown_kinds_to_log():
    e = Emitter(DEAD_URL, None, session_id="s", info={}, queue_size=3, poll_commands=False)
    e.emit("anomaly", {"reason": "nan"})
    e.emit("checked", {"n": 1})
    assert [d["kind"] for d in e._queue] == ["anomaly", "log"]
    assert e._queue[1]["fields"] == {"n": 1, "event": "checked"}
    assert [d["id"] for d in e._queue] == ["s.1", "s.2"]
    for _ in range(3):
        e.emit("log")
    assert e.dropped == 2 and [d["id"] for d in e._queue] == ["s.3", "s.4", "s.5"]
    assert not e._threads  # never started: no thread


def test_state_is_tracked_for_re_registration():
    e = Emitter(DEAD_URL, None, session_id="s", info={}, poll_commands=False)
    e.emit("parked", {"address": "127.0.0.1:5678", "backend": "pdb", "reason": "bp"})
    assert e.state == {
        "state": "parked",
        "reason": "bp",
        "address": "127.0.0.1:5678",
        "listener": "pdb",
    }
    e.emit("resumed", {})
    assert e.state["state"] == "running"


def test_oversized_events_travel_truncated():
    doc = {"id": "s.1", "session": "s", "kind": "log", "time": 1.0, "fields": {"x": "y" * 200_000}}
    encoded = json.loads(_encode(doc))
    assert encoded["fields"]["truncated"] is True and len(encoded["fields"]["preview"]) <= 4096


def test_pending_break_fires_once():
    assert not emitter.pending_break()
    emitter.request_break()
    assert emitter.pending_break() and not emitter.pending_break()


def emitter_threads() -> int:
    """Running threads, less the exit report's SIGTERM reader: one a process, started
    with the first emitter, whichever test that was."""
    return sum(t.name != "breakpod-sigterm" for t in threading.enumerate())


def test_a_started_emitter_with_the_broker_down_keeps_events_and_stops_cleanly():
    before = emitter_threads()
    e = Emitter(DEAD_URL, None, session_id="s", info={}, poll_commands=True).start()
    assert emitter_threads() == before + 2
    e.emit("log", {"n": 1})
    assert not e.flush(timeout=0.3)  # nothing reachable: the event stays queued
    e.close(timeout=2)
    assert emitter_threads() <= before + 1  # the poller may sit in its backoff wait
    assert len(e._queue) >= 1 and e.sent == 0


def test_identity_from_the_downward_api_and_rank_variables():
    env = {"POD_NAME": "train-7f9-0", "POD_NAMESPACE": "ml", "NODE_NAME": "gpu-17", "RANK": "3"}
    env |= {"WORLD_SIZE": "8", "LOCAL_RANK": "-1", "CUDA_VISIBLE_DEVICES": "2"}
    info = identity.describe(env)
    assert info["runtime"] == "kubernetes" and info["pod"] == "train-7f9-0"
    assert (info["namespace"], info["node"], info["rank"], info["world_size"]) == (
        "ml",
        "gpu-17",
        3,
        8,
    )
    assert "local_rank" not in info and info["gpu"] == "2" and info["job"] == "train-7f9"
    assert identity.session_id({"BREAKPOD_SESSION_ID": "my job/rank 0"}) == "my-job-rank-0"
    assert identity.session_id(env).startswith("train-7f9-0-")
    assert identity.runtime({"BREAKPOD_RUNTIME": "compose"}) == "compose"


def test_batches_stop_at_the_byte_limit_and_keep_the_rest_in_order():
    e = Emitter(DEAD_URL, None, session_id="s", info={}, poll_commands=False)
    for n in range(20):
        e.emit("log", {"blob": "x" * 60_000, "n": n})
    batch, body = e._take()
    assert 8 <= len(batch) < 20 and len(body) < 600_000
    assert [d["fields"]["n"] for d in batch] == list(range(len(batch)))
    assert [d["fields"]["n"] for d in e._queue] == list(range(len(batch), 20))
    assert json.loads(body)["events"][0]["id"] == "s.1"


def test_a_process_whose_broker_is_down_still_exits_promptly(spawn):
    child = spawn(
        """
        import time
        from breakpod._link import emitter
        from breakpod._core import events
        emitter.ensure_started()
        events.emit("anomaly", reason="nan")
        time.sleep(0.5)  # the sender has tried and failed by now
        print("done", time.monotonic(), flush=True)
        """,
        env={"BREAKPOD_BROKER_URL": DEAD_URL},
    )
    assert child.wait() == 0
    printed = float(child.stdout().split()[1])
    assert time.monotonic() - printed < 1.5  # finish() did not wait for the dead broker


def test_a_token_read_from_a_file_keeps_working_and_a_garbled_one_is_refused():
    from breakpod._core.errors import BrokerRequestError
    from breakpod._link.client import BrokerClient

    assert BrokerClient("http://127.0.0.1:9", "s3cret\n").token == "s3cret"
    with pytest.raises(BrokerRequestError, match="control characters"):
        BrokerClient("http://127.0.0.1:9", "s3c\x00ret")


def test_names_that_are_not_kubernetes_names_are_left_out_of_the_registration():
    good = identity.describe({"POD_NAME": "train-0", "POD_NAMESPACE": "ml", "NODE_NAME": "n-1.a"})
    assert (good["pod"], good["namespace"], good["node"]) == ("train-0", "ml", "n-1.a")
    bad = identity.describe({"POD_NAME": "x --server=https://evil", "POD_NAMESPACE": "ML_x"})
    assert "pod" not in bad and "namespace" not in bad


# -- exact counters and recovery, against a real broker --------------------------------


def test_every_event_is_counted_exactly_once_while_a_batch_is_in_flight():
    e = Emitter(DEAD_URL, None, session_id="s", info={}, queue_size=5, poll_commands=False)
    for n in range(3):
        e.emit("log", {"n": n})
    batch, _ = e._take()  # in flight: its room in the queue stays reserved
    for n in range(3, 10):
        e.emit("log", {"n": n})
    assert (e.in_flight, len(e._queue), e.dropped) == (3, 2, 5)
    e._requeue(batch)  # the send failed: back in front, nothing more dropped
    assert [d["fields"]["n"] for d in e._queue] == [0, 1, 2, 8, 9]
    assert e.dropped + len(e._queue) + e.in_flight + e.sent + e.rejected == 10


def stored(broker, session_id: str) -> list[int]:
    from tests.brokerkit import ADMIN

    with broker.client(ADMIN) as c:
        page = c.get("/v1/events", params={"session": session_id, "kind": "log", "limit": 1000})
    assert page.status_code == 200, page.text
    return [e["fields"]["n"] for e in page.json()["events"]]


def test_a_batch_that_lands_late_is_neither_lost_nor_counted_as_dropped(broker):
    from tests.brokerkit import AGENT

    e = Emitter(broker.url, AGENT, session_id="late", info={}, queue_size=5, poll_commands=False)
    e._register_or_beat()
    for n in range(3):
        e.emit("log", {"n": n})
    batch, body = e._take()
    e._client.request("POST", "/v1/events", body)  # it lands ...
    for n in range(3, 10):
        e.emit("log", {"n": n})  # ... while the queue fills up ...
    e._requeue(batch)  # ... and the sender saw a timeout
    e.start()
    assert e.flush(timeout=15)
    e.close()
    assert stored(broker, "late") == [0, 1, 2, 8, 9]  # the retry was a duplicate, dropped there
    assert (e.sent, e.dropped, e.in_flight, len(e._queue)) == (5, 5, 0, 0)


@pytest.mark.timeout(90)
def test_delivery_resumes_within_seconds_after_a_broker_outage(start_broker):
    from tests.brokerkit import AGENT, wait_until

    b = start_broker()
    e = Emitter(b.url, AGENT, session_id="outage", info={}, poll_commands=False).start()
    try:
        e.emit("log", {"n": 0})
        assert e.flush(timeout=15)
        b.stop()
        e.emit("log", {"n": 1})
        time.sleep(8)  # long enough for an uncapped backoff to reach 8 s
        b.start()
        back = time.monotonic()
        wait_until(lambda: stored(b, "outage") == [0, 1], timeout=20, interval=0.05)
        recovery = time.monotonic() - back
    finally:
        e.close()
    assert recovery < 4.0, f"delivery resumed {recovery:.2f}s after the broker came back"


EMITS_UNTIL_GO = """
    import os, socket, sys, time
    from breakpod._link import emitter
    from breakpod._core import events
    emitter.ensure_started()
    n = 0
    while not os.path.exists({go!r}):  # keeps the sender busy: through the outage it backs off
        events.emit("log", n=n)
        n += 1
        time.sleep(0.1)
    while {await_broker}:  # exit the moment the broker's port is back: the sender still waits
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
            break
        except OSError:
            time.sleep(0.01)
    print("exiting", time.monotonic(), flush=True)
    sys.exit(3)
"""


def registered(broker, session_id: str):
    from tests.brokerkit import VIEWER

    with broker.client(VIEWER) as c:
        reply = c.get(f"/v1/sessions/{session_id}")
    return reply.json() if reply.status_code == 200 else None


def job_in_an_outage(start_broker, spawn, go, session_id: str, *, await_broker: bool):
    """A job reporting to a real broker; the broker is stopped and the sender has
    been backing off for a while (its waits reach a second or two)."""
    from tests.brokerkit import AGENT, wait_until

    broker = start_broker()
    script = EMITS_UNTIL_GO.format(go=str(go), await_broker=await_broker, port=broker.port)
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(script, env={**env, "BREAKPOD_SESSION_ID": session_id})
    wait_until(lambda: registered(broker, session_id), timeout=20)
    broker.stop()
    child.wait_for("broker unreachable, events queued", timeout=20)
    time.sleep(3)  # the backoff doubles to its cap: 0.25, 0.5, 1, 2 s
    return broker, child


@pytest.mark.timeout(120)
def test_a_job_that_ends_as_the_broker_returns_still_shows_finished(start_broker, spawn, tmp_path):
    """The job exits the moment the broker is back, its sender asleep in a backoff
    wait: finish() wakes it, and the final event arrives."""
    from tests.brokerkit import wait_until

    go = tmp_path / "go"
    broker, child = job_in_an_outage(start_broker, spawn, go, "on-return", await_broker=True)
    go.touch()
    broker.start()  # same port, same Redis
    assert child.wait() == 3, child.stderr
    session = wait_until(lambda: registered(broker, "on-return"), timeout=20)
    assert (session["state"], session["reason"]) == ("failed", "exit 3")
    assert "did not get" not in child.stderr


@pytest.mark.timeout(120)
def test_a_job_that_ends_while_the_broker_is_down_says_so_and_exits_promptly(
    start_broker, spawn, tmp_path
):
    go = tmp_path / "go"
    broker, child = job_in_an_outage(start_broker, spawn, go, "in-outage", await_broker=False)
    go.touch()
    assert child.wait() == 3, child.stderr
    took = time.monotonic() - float(child.stdout().split()[1])
    assert took < 2.5, f"the exit waited {took:.2f}s for a broker that is down"
    said = [line for line in child.stderr.splitlines() if "did not get" in line]
    assert said == [
        f"breakpod: the broker at {broker.url} did not get this process's exit (exit 3); "
        "session in-outage will read as lost there"
    ]
    broker.start()  # back, it never heard of the exit: the session is not finished
    assert registered(broker, "in-outage")["state"] != "finished"


def test_half_of_a_utf16_pair_travels_as_a_replacement_character():
    """Python reads bytes that are not UTF-8 (a file name, an environment value) as
    surrogates with no partner; the broker refuses them, so the event would be lost."""
    name = b"ckpt-\xff.pt".decode("utf-8", "surrogateescape")
    fields = {"path": name, name: "nan", "emoji": "\U0001f600"}
    encoded = _encode({"id": "s.1", "session": "s", "kind": "log", "time": 1.0, "fields": fields})
    encoded.decode("utf-8")  # text through and through
    assert json.loads(encoded)["fields"] == {
        "path": "ckpt-\ufffd.pt",
        "ckpt-\ufffd.pt": "nan",
        "emoji": "\U0001f600",
    }


@pytest.mark.parametrize("size", ["0", "-5"])
def test_a_queue_size_below_one_is_refused_and_said_once(spawn, size):
    """BREAKPOD_EMIT_QUEUE=0 became a queue of 1 without a word."""
    child = spawn(
        """
        from breakpod._link import emitter
        assert emitter.ensure_started() is None and emitter.ensure_started() is None
        print("ran")
        """,
        env={"BREAKPOD_BROKER_URL": DEAD_URL, "BREAKPOD_EMIT_QUEUE": size},
    )
    assert child.wait() == 0 and child.stdout().strip() == "ran"
    lines = [line for line in child.stderr.splitlines() if "BREAKPOD_EMIT_QUEUE" in line]
    assert len(lines) == 1 and f"={size} is not a positive number" in lines[0], child.stderr


def test_a_runtime_that_is_none_of_the_four_is_said_once_and_detected(spawn):
    """BREAKPOD_RUNTIME=mars was ignored without a word."""
    child = spawn(
        """
        from breakpod._core import identity
        print(*{identity.describe()["runtime"] for _ in range(3)})
        """,
        env={"BREAKPOD_RUNTIME": "mars"},
    )
    assert child.wait() == 0, child.stderr
    assert child.stdout().strip() in ("local", "docker", "kubernetes", "compose")
    lines = [line for line in child.stderr.splitlines() if "BREAKPOD_RUNTIME" in line]
    assert len(lines) == 1 and "'mars' is not one of" in lines[0], child.stderr
