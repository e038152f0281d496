"""Uncaught exceptions in a headless process open a remote post-mortem."""

from __future__ import annotations

import pytest

CRASH = """
    import breakpod
    breakpod.install_excepthook()

    def divide(total, parts):
        share = total / parts
        return share

    print("started", flush=True)
    divide(10, 0)
"""


def test_post_mortem_is_inspectable_then_exits_1(spawn, pdb_client):
    child = spawn(CRASH)
    client = pdb_client(child.park_port())
    banner = client.read_until()
    assert "uncaught ZeroDivisionError" in banner
    assert "share = total / parts" in banner  # the failing frame
    assert client.command("p total, parts").strip() == "(10, 0)"
    client.send("c")
    client.read_all()
    assert child.wait() == 1
    assert "Traceback" in child.stderr and "ZeroDivisionError" in child.stderr


def test_post_mortem_without_a_client_exits_after_the_hold_time(spawn):
    child = spawn(CRASH, env={"BREAKPOD_HOLD_SECONDS": "0.5"})
    assert child.wait() == 1
    assert "nobody attached within 0.5s" in child.stderr


def test_env_switch_enables_post_mortem_without_code_changes(spawn, pdb_client):
    child = spawn("x = 7\nraise RuntimeError('boom')\n", env={"BREAKPOD_POST_MORTEM": "1"})
    client = pdb_client(child.park_port())
    client.read_until()
    assert client.command("p x").strip() == "7"
    client.close()  # a disconnect ends the session too
    assert child.wait() == 1


def test_exit_status_is_kept_for_system_exit(spawn):
    child = spawn("import sys\nsys.exit(3)\n", env={"BREAKPOD_POST_MORTEM": "1"})
    assert child.wait() == 3
    assert "waiting" not in child.stderr


@pytest.mark.parametrize("value", ["maybe", "2", "enabled"])
def test_a_post_mortem_flag_that_is_no_yes_or_no_is_said_and_stays_off(spawn, value) -> None:
    """The autostart .pth read anything but 1/true/yes/on as off, without a word, while
    every other yes/no variable says a bad value."""
    child = spawn(
        "raise SystemExit('crashed')", env={"BREAKPOD_POST_MORTEM": value}, breakpod=False
    )
    assert child.wait() == 1
    said = [line for line in child.stderr.splitlines() if "BREAKPOD_POST_MORTEM" in line]
    assert len(said) == 1 and "is not a boolean" in said[0], child.stderr
