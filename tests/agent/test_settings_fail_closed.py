"""Bad settings never open the listener: each bad value is named and falls back alone;
a bad or missing security value means no listener at all, and the job goes on."""

from __future__ import annotations

import dataclasses
import socket

import pytest

import breakpod
from breakpod._core.config import ENV, SECURITY, Settings
from breakpod._debug import debugger

GOOD_TOKEN = "tok-abcdefgh"
TOKENED = {"BREAKPOD_REQUIRE_TOKEN": "1", "BREAKPOD_LISTENER_TOKEN": GOOD_TOKEN}

SCRIPT = """
    x = 41
    breakpoint()
    x += 1
    print("finished", x)
"""

# (environment, the variable the one loud line must name)
BAD_SECURITY = [
    ({"BREAKPOD_REQUIRE_TOKEN": "1"}, "BREAKPOD_REQUIRE_TOKEN"),
    ({"BREAKPOD_REQUIRE_TOKEN": "1", "BREAKPOD_LISTENER_TOKEN": "   \n"}, "BREAKPOD_REQUIRE_TOKEN"),
    ({"BREAKPOD_REQUIRE_TOKEN": "1", "BREAKPOD_LISTENER_TOKEN": "a"}, "BREAKPOD_LISTENER_TOKEN"),
    ({"BREAKPOD_LISTENER_TOKEN": "short"}, "BREAKPOD_LISTENER_TOKEN"),
    ({"BREAKPOD_LISTENER_TOKEN": "tok abcdefgh"}, "BREAKPOD_LISTENER_TOKEN"),
    ({**TOKENED, "BREAKPOD_REQUIRE_TOKEN": "maybe"}, "BREAKPOD_REQUIRE_TOKEN"),
    ({**TOKENED, "BREAKPOD_HOST": "127.0.0.1; rm -rf"}, "BREAKPOD_HOST"),
    ({**TOKENED, "BREAKPOD_HOST": "a..b"}, "BREAKPOD_HOST"),  # the name lookup raised
    ({**TOKENED, "BREAKPOD_ALLOW_INSECURE": "perhaps"}, "BREAKPOD_ALLOW_INSECURE"),
]

# (variable, bad value, the field, what it falls back to)
BAD_ORDINARY = [
    ("BREAKPOD_ON_DETACH", "later", "on_detach", "continue"),
    ("BREAKPOD_HOLD_SECONDS", "5m", "hold_seconds", 300.0),
    ("BREAKPOD_HOLD_SECONDS", "nan", "hold_seconds", 300.0),  # was: a park with no end
    ("BREAKPOD_QUIT", "maybe", "quit_mode", "detach"),
    ("BREAKPOD_ATTACH_IDLE", "soon", "attach_idle", 900.0),
    ("BREAKPOD_WAIT_TIMEOUT", "later", "wait_timeout", 300.0),
    ("BREAKPOD_BACKEND", "gdb", "backend", "auto"),
    ("BREAKPOD_POST_MORTEM", "sure", "post_mortem", False),
    ("LOCAL_RANK", "-70000", "local_rank", 0),
    ("LOCAL_RANK", "two", "local_rank", 0),
]


@pytest.mark.parametrize(("env", "var"), BAD_SECURITY)
def test_a_bad_security_value_refuses_the_listener_loudly_and_the_job_continues(spawn, env, var):
    child = spawn(SCRIPT, env=env, stdin="closed")
    assert child.wait() == 0, child.stderr
    assert "finished 42" in child.stdout()
    lines = [line for line in child.stderr.splitlines() if "no debugger listener" in line]
    assert len(lines) == 1 and var in lines[0], child.stderr
    assert "waiting" not in child.stderr and "Traceback" not in child.stderr
    assert GOOD_TOKEN not in child.stderr  # never echoed


@pytest.mark.parametrize(("var", "bad", "field", "default"), BAD_ORDINARY)
def test_a_bad_ordinary_value_falls_back_alone(var, bad, field, default):
    env = {**TOKENED, "BREAKPOD_HOST": "::1", var: bad}
    settings, lines = Settings.load(env)
    assert getattr(settings, field) == default
    assert len(lines) == 1 and lines[0].startswith(f"{var}={bad!r}") and "default" in lines[0]
    assert settings.refused is None
    kept = dataclasses.replace(settings, **{field: getattr(Settings, field)})
    assert (kept.token, kept.require_token, kept.host) == (GOOD_TOKEN, True, "::1")


@pytest.mark.parametrize(("var", "bad", "field", "default"), BAD_ORDINARY[:3])
def test_after_an_ordinary_fallback_the_token_is_still_required(
    spawn, pdb_client, var, bad, field, default
):
    child = spawn(SCRIPT, env={**TOKENED, var: bad}, stdin="closed")
    client = pdb_client(child.park_port())
    assert "token required" in client.read_until("\n")
    client.send("wrong-token")
    refusal = client.read_all()
    assert "wrong or missing token" in refusal and "(Pdb)" not in refusal
    good = pdb_client(child.park_port())
    good.read_until("\n")
    good.send(GOOD_TOKEN)
    assert "attached" in good.read_until()
    good.send("c")
    assert child.wait() == 0 and "finished 42" in child.stdout()
    assert child.stderr.count(f"{var}={bad!r}") == 1


def test_the_issue_reproduction_asks_for_the_token(spawn):
    """BREAKPOD_ON_DETACH=later used to drop the token requirement with the rest."""
    child = spawn(SCRIPT, env={**TOKENED, "BREAKPOD_ON_DETACH": "later"}, stdin="closed")
    with socket.create_connection(("127.0.0.1", child.park_port()), timeout=10) as nc:
        prompt = nc.recv(200)
    assert prompt.startswith(b"breakpod: token required")
    assert b"send BREAKPOD_LISTENER_TOKEN as" in prompt  # it named the deprecated BREAKPOD_TOKEN


def test_a_token_read_from_a_file_matches_what_the_cli_sends(spawn, pdb_client):
    child = spawn(SCRIPT, env={**TOKENED, "BREAKPOD_LISTENER_TOKEN": GOOD_TOKEN + "\n"})
    client = pdb_client(child.park_port())
    client.read_until("\n")
    client.send(GOOD_TOKEN + " \r")
    assert "attached" in client.read_until()
    client.send("c")
    assert child.wait() == 0


def test_every_security_setting_is_covered_here():
    named = {var for env, var in BAD_SECURITY}
    assert named == {ENV[field] for field in SECURITY}


def test_the_strict_form_still_raises_naming_the_variable():
    with pytest.raises(breakpod.ConfigError, match="LOCAL_RANK='-70000' is not a local rank"):
        Settings.from_env({"LOCAL_RANK": "-70000"})
    with pytest.raises(breakpod.ConfigError, match="BREAKPOD_LISTENER_TOKEN must be at least 8"):
        Settings.from_env({"BREAKPOD_LISTENER_TOKEN": "abc"})


def test_init_remote_debugger_refuses_a_bad_token_with_one_line(monkeypatch, capfd):
    monkeypatch.setattr(debugger._State, "pdb", None)
    monkeypatch.setenv("BREAKPOD_LISTENER_TOKEN", "abc")
    assert breakpod.init_remote_debugger(port=0, backend="pdb", enable=True) is None
    assert debugger._State.pdb is None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "BREAKPOD_LISTENER_TOKEN must be at least 8" in err


@pytest.mark.parametrize("rank", ["-70000", "70000", "x"])
def test_a_bad_local_rank_is_one_line_not_a_traceback(spawn, rank):
    child = spawn(
        """
        import breakpod
        endpoint = breakpod.init_remote_debugger(backend="pdb", enable=True)
        print("listening", endpoint is not None)
        """,
        env={"LOCAL_RANK": rank},
        stdin="closed",
    )
    assert child.wait() == 0, child.stderr
    assert "listening True" in child.stdout()
    assert "Traceback" not in child.stderr
    assert f"LOCAL_RANK={rank!r} is not a local rank" in child.stderr


@pytest.mark.parametrize("bad", ["-1", "1e308", "1e400", "-inf", "2e9"])
def test_seconds_that_are_negative_or_past_31_years_fall_back_with_a_line(bad):
    """-1 and 1e400 meant no limit, without a word: 'forever' says that."""
    settings, lines = Settings.load({**TOKENED, "BREAKPOD_HOLD_SECONDS": bad})
    assert settings.hold_seconds == 300.0
    (line,) = lines
    assert line.startswith(f"BREAKPOD_HOLD_SECONDS={bad!r}") and "'forever'" in line, line


@pytest.mark.parametrize("endless", ["forever", "inf", "none", " Infinite "])
def test_no_limit_is_said_in_words(endless):
    settings, lines = Settings.load({**TOKENED, "BREAKPOD_HOLD_SECONDS": endless})
    assert settings.hold_seconds == float("inf") and not lines


@pytest.mark.parametrize(
    "var", ["BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_REPLAY", "ENABLE_REMOTE_DEBUG"]
)
def test_a_bad_yes_no_value_keeps_the_default_and_watch_works(monkeypatch, capfd, var):
    """It raised out of ``watch()``: a typo in a variable killed the training job."""
    import torch

    monkeypatch.setenv(var, "maybe")
    model = torch.nn.Linear(2, 2)
    for _ in range(2):  # said once
        monitor = breakpod.watch(model)
        model(torch.ones(1, 2)).sum().backward()
        monitor.step()
        assert monitor.enabled and monitor.errors == 0
        monitor.close()
    said = [line for line in capfd.readouterr().err.splitlines() if "not a boolean" in line]
    assert len(said) == 1 and var in said[0] and "keeping the default" in said[0], said


# The same matrix for the debugpy backend, which has no authentication: where the remote
# pdb would ask for the token, debugpy may not listen at all (no fallback, one line).
DEBUGPY_SCRIPT = """
    import breakpod
    endpoint = breakpod.init_remote_debugger(port={port}, backend={backend!r}, enable=True)
    print("endpoint", endpoint, flush=True)
"""
TOKEN_POLICY = [
    (TOKENED, "BREAKPOD_REQUIRE_TOKEN"),  # was: a DAP client without the token ran code
    (
        {"BREAKPOD_LISTENER_TOKEN": GOOD_TOKEN, "BREAKPOD_HOST": "0.0.0.0"},
        "BREAKPOD_LISTENER_TOKEN",
    ),
    (
        {"BREAKPOD_LISTENER_TOKEN": GOOD_TOKEN, "BREAKPOD_HOST": "0.0.0.0"}
        | {"BREAKPOD_ALLOW_INSECURE": "1"},
        "BREAKPOD_LISTENER_TOKEN",
    ),
]
AFTER_FALLBACK = [
    ({**TOKENED, var: bad}, "BREAKPOD_REQUIRE_TOKEN") for var, bad, *_ in BAD_ORDINARY
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["debugpy", "auto"])
@pytest.mark.parametrize(("env", "var"), BAD_SECURITY + TOKEN_POLICY + AFTER_FALLBACK[:3])
def test_debugpy_under_a_token_policy_or_a_bad_security_value_never_listens(
    spawn, backend, env, var
):
    pytest.importorskip("debugpy")
    port = free_port()
    child = spawn(DEBUGPY_SCRIPT.format(port=port, backend=backend), env=env, stdin="closed")
    assert child.wait() == 0, child.stderr
    assert "endpoint None" in child.stdout(), child.stderr
    lines = [line for line in child.stderr.splitlines() if "no debugger listener" in line]
    assert len(lines) == 1 and var in lines[0], child.stderr
    assert "debugpy listening" not in child.stderr and "Traceback" not in child.stderr
    assert GOOD_TOKEN not in child.stderr
    with pytest.raises(ConnectionRefusedError):  # nothing to send initialize/attach to
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize("backend", ["debugpy", "auto"])
def test_debugpy_without_a_token_policy_still_listens_on_loopback(spawn, backend):
    """A token set but not asked for on loopback (as the remote pdb would not ask)."""
    pytest.importorskip("debugpy")
    env = {"BREAKPOD_LISTENER_TOKEN": GOOD_TOKEN}
    child = spawn(DEBUGPY_SCRIPT.format(port=0, backend=backend), env=env, stdin="closed")
    assert child.wait() == 0, child.stderr
    assert "debugpy listening on 127.0.0.1:" in child.stderr
    assert "no debugger listener" not in child.stderr
