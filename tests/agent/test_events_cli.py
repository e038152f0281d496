"""``breakpod events``: one line per event by default, ``--json`` whole objects one per
line, ``--full`` long fields (stack dumps) whole and indented below their event."""

from __future__ import annotations

import json

from tests.agent.test_attach_cli import run_cli
from tests.brokerkit import VIEWER, post_events, register

STACKS = "".join(
    f'  File "train.py", line {n}, in step_{n}\n    loss = model(x)\n' for n in range(40)
)


def events_cli(broker, *args):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_BROKER_TOKEN": VIEWER}
    return run_cli("events", "--session", "s-ev", *args, env=env)


def test_events_as_lines_json_and_full(broker):
    register(broker, "s-ev")
    doc = {"message": "stacks of every thread", "stacks": STACKS, "table": {"a": [1, 2]}}
    assert post_events(broker, {"id": "s-ev.1", "session": "s-ev", "kind": "log", "fields": doc})

    line = events_cli(broker)
    assert line.returncode == 0, line.stderr
    assert line.stdout.count("\n") == 1 and "stacks=" in line.stdout and "..." in line.stdout

    whole = events_cli(broker, "--json")
    assert whole.returncode == 0, whole.stderr
    (event,) = [json.loads(text) for text in whole.stdout.splitlines()]
    assert event["fields"]["stacks"] == STACKS and event["kind"] == "log"

    full = events_cli(broker, "--full")
    assert full.returncode == 0, full.stderr
    first, *rest = full.stdout.splitlines()
    assert "message=stacks of every thread" in first and "stacks=" not in first
    assert "  stacks:" in rest
    assert [r[4:] for r in rest if r.startswith("    ") and "File" in r] == [
        s for s in STACKS.splitlines() if "File" in s
    ]  # every frame, none cut
    assert events_cli(broker, "--json", "--full").returncode == 2
