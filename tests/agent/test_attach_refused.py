"""`breakpod attach` with a wrong token exits non-zero; the park hint names the token."""

from __future__ import annotations

from tests.agent.test_attach_cli import run_cli
from tests.agent.test_breakpoint import SCRIPT, TOKEN_ENV


def test_a_refused_token_exits_non_zero_and_says_why(spawn):
    child = spawn(SCRIPT, env=TOKEN_ENV, stdin="closed")
    port = child.park_port()
    result = run_cli("attach", f"127.0.0.1:{port}", env={"BREAKPOD_LISTENER_TOKEN": "wrong-token"})
    assert result.returncode != 0, result.stdout
    assert "the listener refused this client: wrong or missing token" in result.stderr
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
