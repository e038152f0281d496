"""What a session says of its incident, in the API and in `breakpod sessions`' REASON:
a stall's culprit on every stalled rank, where and for how long; a park's hold
deadline; who is attached; how a process ended."""

from __future__ import annotations

import re
import time

from tests.broker.test_flow import cli
from tests.brokerkit import VIEWER, post_events, register

REPORT = {  # rank 0's job-wide report, as the watchdog sends it
    "scope": "job",
    "seconds": 12.0,
    "culprits": [1],
    "ranks": [
        {
            "rank": 0,
            "step": 8,
            "state": "collective",
            "entered": 9,
            "op": "allreduce",
            "frame": "train.py:40 in step",
        },
        {"rank": 1, "step": 7, "state": "user", "entered": 8, "frame": "data.py:12 in fetch"},
    ],
}


def sessions(broker):
    with broker.client(VIEWER) as c:
        return {s["id"]: s for s in c.get("/v1/sessions").json()["sessions"]}


def rows(listing):
    return {line.split()[0]: line for line in listing.splitlines()[1:] if line.strip()}


def test_a_job_stall_names_its_culprit_on_every_stalled_rank_and_in_the_reason_column(broker):
    for rank in (0, 1):
        register(broker, f"r{rank}", job="train", rank=rank, world_size=2)
    register(broker, "other", job="another", rank=0)
    own = {"seconds": 11.0, "step": 7, "rank": 1, "state": "user", "frame": "data.py:12 in fetch"}
    post_events(
        broker,
        {"id": "s1", "session": "r1", "kind": "stall", "fields": own},
        {"id": "s0", "session": "r0", "kind": "stall", "fields": {"seconds": 11.5, "rank": 0}},
        {"id": "j", "session": "r0", "kind": "stall", "time": time.time(), "fields": REPORT},
        {"id": "o", "session": "other", "kind": "stall", "fields": {"seconds": 3}},
    )
    found = sessions(broker)
    line = "rank 1 at data.py:12 in fetch (step 7, in user code)"
    assert found["r0"]["culprit"] == found["r1"]["culprit"] == line
    assert found["other"]["culprit"] is None  # another job's stall blames nobody here
    assert found["r1"]["reason"] == "no step for 11.0s at step 7 in data.py:12 in fetch (user)"
    assert time.time() - found["r0"]["since"] >= 12.0  # the stall began at the last step
    listing = rows(cli(broker, "sessions").stdout)
    for rank in ("r0", "r1"):
        assert re.search(re.escape(f"culprit {line}; for ") + r"1[1-4]s", listing[rank])
    assert "culprit" not in listing["other"] and "no step for 3s" in listing["other"]


def test_a_rank_whose_own_stall_comes_after_the_report_is_named_its_culprit_too(broker):
    """On a loaded node a rank's sender may flush its own stall after rank 0's report:
    its session was not stalled when the report came, and said no culprit at all. It
    takes the report's line when the report found it at the step its own event names;
    a later stall at another step does not take an old report's line."""
    for rank in (0, 1):
        register(broker, f"r{rank}", job="train", rank=rank, world_size=2)
    post_events(broker, {"id": "j", "session": "r0", "kind": "stall", "fields": REPORT})
    own = {"seconds": 11.0, "step": 7, "rank": 1, "state": "user", "frame": "data.py:12 in fetch"}
    post_events(broker, {"id": "s1", "session": "r1", "kind": "stall", "fields": own})
    line = "rank 1 at data.py:12 in fetch (step 7, in user code)"
    assert sessions(broker)["r1"]["culprit"] == line
    assert f"culprit {line}" in rows(cli(broker, "sessions").stdout)["r1"]

    post_events(broker, {"id": "r", "session": "r1", "kind": "resumed", "fields": {}})
    later = {**own, "step": 30}  # another stall, which no report has covered yet
    post_events(broker, {"id": "s2", "session": "r1", "kind": "stall", "fields": later})
    assert sessions(broker)["r1"]["culprit"] is None


def test_the_culprit_goes_when_the_stall_is_over(broker):
    register(broker, "r0", job="train", rank=0)
    post_events(broker, {"id": "j", "session": "r0", "kind": "stall", "fields": REPORT})
    assert sessions(broker)["r0"]["culprit"]
    post_events(broker, {"id": "r", "session": "r0", "kind": "resumed", "fields": {}})
    assert sessions(broker)["r0"]["culprit"] is None


def test_a_park_carries_its_hold_deadline_and_an_attach_who_is_attached(broker):
    register(broker, "p")
    until = time.time() + 300
    parked = {"reason": "NaN in loss", "address": "127.0.0.1:5678", "hold_until": until}
    post_events(broker, {"id": "a", "session": "p", "kind": "parked", "fields": parked})
    session = sessions(broker)["p"]
    assert session["hold_until"] == until and session["state"] == "parked"
    assert "NaN in loss; holds 4m more" in rows(cli(broker, "sessions").stdout)["p"]
    attached = {"reason": "NaN in loss", "client": "127.0.0.1:40112"}
    post_events(broker, {"id": "b", "session": "p", "kind": "attached", "fields": attached})
    session = sessions(broker)["p"]
    assert session["attached_by"] == "127.0.0.1:40112" and session["hold_until"] is None
    assert "attached: 127.0.0.1:40112" in rows(cli(broker, "sessions").stdout)["p"]


def test_how_each_session_ended_is_its_state_and_reason(broker):
    ends = {
        "ok": ("finished", {"exit": 0}, "exit 0"),
        "bad": ("finished", {"exit": 1}, "exit 1"),
        "term": ("finished", {"signal": 15}, "signal 15 (SIGTERM)"),
        "oom": ("killed", {"reason": "OOMKilled", "exit": 137}, "OOMKilled (exit 137)"),
    }
    for session_id, (kind, fields, _) in ends.items():
        register(broker, session_id)
        post_events(broker, {"id": "e", "session": session_id, "kind": kind, "fields": fields})
    found = sessions(broker)
    states = {i: (found[i]["state"], found[i]["reason"]) for i in ends}
    assert states == {
        "ok": ("finished", "exit 0"),
        "bad": ("failed", "exit 1"),
        "term": ("killed", "signal 15 (SIGTERM)"),
        "oom": ("killed", "OOMKilled (exit 137)"),
    }
    listing = rows(cli(broker, "sessions").stdout)
    assert "failed" in listing["bad"] and "exit 1" in listing["bad"]
    assert "killed" in listing["oom"] and "OOMKilled (exit 137)" in listing["oom"]
