"""`breakpod attach` with a wrong token exits non-zero; the park hint names the token."""

from __future__ import annotations

from tests.agent.test_attach_cli import run_cli
from tests.agent.test_breakpoint import SCRIPT, TOKEN_ENV


def test_a_refused_token_exits_non_zero_and_says_why(spawn):
    child = spawn(SCRIPT, env=TOKEN_ENV, stdin="closed")
    port = child.park_port()
    result = run_cli("attach", f"127.0.0.1:{port}", env={"BREAKPOD_LISTENER_TOKEN": "wrong-token"})
    assert result.returncode != 0, result.stdout
    said = result.stdout + result.stderr
    assert "the listener refused this client: wrong or missing token" in result.stderr
    assert said.count("wrong or missing token") == 1, said  # said once, as a refusal
    assert "broke" not in said
    right = run_cli(
        "attach", f"127.0.0.1:{port}", stdin="c\n", env={"BREAKPOD_LISTENER_TOKEN": "s3cret-token"}
    )
    assert right.returncode == 0, right.stderr
    assert child.wait() == 0


def test_the_park_hint_says_a_token_is_required_when_it_is(spawn):
    tokened = spawn(SCRIPT, env=TOKEN_ENV, stdin="closed")
    tokened.park_port()
    assert "a token is required: set BREAKPOD_LISTENER_TOKEN" in tokened.stderr
    plain = spawn(SCRIPT, stdin="closed")
    plain.park_port()
    assert "token" not in plain.stderr


def test_a_listener_not_parked_yet_says_so_and_the_session_starts_at_its_park(spawn):
    """``breakpod attach`` to the address 'remote pdb ready' printed, before any park:
    the listener says at once that it is not parked (it said nothing, and the client
    took it for a wrong address after 10 s), and the session starts at the park."""
    child = spawn(
        """
        import time, breakpod
        breakpod.init_remote_debugger(port=0, backend="pdb", enable=True)
        time.sleep(12)  # longer than the client waits for a first word
        x = 41
        breakpoint()
        print("finished", x, flush=True)
        """,
        stdin="closed",
    )
    port = int(child.wait_for(r"remote pdb ready on 127\.0\.0\.1:(\d+)").group(1))
    result = run_cli("attach", f"127.0.0.1:{port}", stdin="p x\nc\n", timeout=40)
    assert result.returncode == 0, result.stderr
    assert "is not parked yet" in result.stdout and "41" in result.stdout
    assert child.wait() == 0
