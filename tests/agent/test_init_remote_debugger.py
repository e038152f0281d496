"""init_remote_debugger: disabled by default, pre-binds pdb, one port per rank."""

from __future__ import annotations

import socket
import threading

import pytest

import breakpod
from breakpod._core.config import Settings
from breakpod._debug import debugger


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    for var in ("ENABLE_REMOTE_DEBUG", "BREAKPOD_PORT", "LOCAL_RANK", "BREAKPOD_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(debugger._State, "pdb", None)
    monkeypatch.setattr(debugger._State, "debugpy", None)
    yield
    if debugger._State.pdb is not None:
        debugger._State.pdb.close()


def test_disabled_by_default_starts_nothing():
    before = threading.active_count()
    assert breakpod.init_remote_debugger() is None
    assert debugger._State.pdb is None and debugger._State.debugpy is None
    assert threading.active_count() == before


def test_env_enables_and_pdb_backend_prebinds_a_port(monkeypatch):
    monkeypatch.setenv("ENABLE_REMOTE_DEBUG", "1")
    endpoint = breakpod.init_remote_debugger(port=0, backend="pdb")
    assert endpoint is not None and endpoint.backend == "pdb" and endpoint.host == "127.0.0.1"
    with socket.create_connection((endpoint.host, endpoint.port), timeout=5):
        pass  # accepting connections before any breakpoint()
    again = breakpod.init_remote_debugger(port=0, backend="pdb")
    assert again == endpoint  # calling twice reuses the listener


def test_local_rank_offsets_the_port(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert Settings.from_env(port=6000).listen_port == 6003
    assert Settings.from_env(port=0).listen_port == 0  # any free port stays any


def test_bad_backend_is_a_clear_error():
    with pytest.raises(breakpod.ConfigError, match="backend='gdb' is not one of"):
        breakpod.init_remote_debugger(backend="gdb", enable=True)


def test_debugpy_on_non_loopback_needs_explicit_insecure_opt_in():
    with pytest.raises(breakpod.InsecureBindError, match="BREAKPOD_ALLOW_INSECURE=1"):
        breakpod.init_remote_debugger(host="0.0.0.0", backend="debugpy", enable=True)


def test_pdb_on_non_loopback_needs_a_token():
    with pytest.raises(breakpod.InsecureBindError, match="BREAKPOD_LISTENER_TOKEN"):
        breakpod.init_remote_debugger(host="0.0.0.0", backend="pdb", enable=True)


@pytest.mark.parametrize("backend", ["pdb", "debugpy"])
def test_a_non_loopback_bind_asked_by_the_environment_is_announced_not_raised(
    backend, monkeypatch, capfd
):
    monkeypatch.setenv("BREAKPOD_HOST", "0.0.0.0")
    monkeypatch.setenv("BREAKPOD_BACKEND", backend)
    assert breakpod.init_remote_debugger(enable=True) is None  # the job goes on
    said = capfd.readouterr().err
    assert "no debugger listener in this process" in said
    assert "BREAKPOD_LISTENER_TOKEN" in said or "BREAKPOD_ALLOW_INSECURE=1" in said


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("BREAKPOD_PORT", "70000", "is not a TCP port"),
        ("ENABLE_REMOTE_DEBUG", "maybe", "is not a boolean"),
        ("BREAKPOD_HOLD_SECONDS", "soon", "is not a number of seconds"),
        ("BREAKPOD_ON_DETACH", "explode", "is not one of: continue, wait"),
    ],
)
def test_bad_environment_values_name_the_variable(var, value, message):
    with pytest.raises(breakpod.ConfigError, match=f"{var}=.*{message}"):
        Settings.from_env({var: value})


WAIT = """
    import breakpod
    x = 5
    breakpod.init_remote_debugger(port=0, backend="pdb", wait=True, enable=True)
    print("after wait", x, flush=True)
"""


def test_wait_parks_at_the_call_until_a_client_attaches(spawn, pdb_client):
    child = spawn(WAIT)
    client = pdb_client(child.park_port())
    assert 'print("after wait"' in client.read_until()
    assert client.command("p x").strip() == "5"
    client.send("c")
    assert child.wait() == 0
    assert "after wait 5" in child.stdout()


def test_wait_times_out_and_continues_with_a_warning(spawn):
    child = spawn(WAIT, env={"BREAKPOD_WAIT_TIMEOUT": "0.5"})
    assert child.wait() == 0
    assert "nobody attached within 0.5s" in child.stderr
    assert "after wait 5" in child.stdout()


@pytest.mark.parametrize("off", ["false", "no", "0", "off", "", " False "])
def test_enable_as_text_reads_as_the_variable_does(off):
    """enable="false" started a listener (the text was judged by its truthiness)."""
    assert breakpod.init_remote_debugger(port=0, backend="pdb", enable=off) is None
    assert debugger._State.pdb is None
    endpoint = breakpod.init_remote_debugger(port=0, backend="pdb", enable="yes")
    assert endpoint is not None and endpoint.backend == "pdb"


@pytest.mark.parametrize("bad", ["maybe", 1, 0.0, []])
def test_enable_that_is_neither_yes_nor_no_is_one_clear_error(bad):
    with pytest.raises(breakpod.ConfigError, match=r"enable=.* is not a boolean"):
        breakpod.init_remote_debugger(port=0, backend="pdb", enable=bad)
    assert debugger._State.pdb is None


@pytest.mark.parametrize("bad", [True, False, "x", -1, 70000, 65536, 5678.0, "5678x", b"80"])
def test_a_port_that_is_not_a_tcp_port_is_one_clear_error(bad):
    """port="x" raised a bare TypeError, -1 debugpy's ValueError or bind()'s
    OverflowError, and port=True meant port 1."""
    for backend in ("pdb", "debugpy"):
        with pytest.raises(
            breakpod.ConfigError, match=r"port=.* is not a TCP port: use 0\.\.65535"
        ):
            breakpod.init_remote_debugger(port=bad, backend=backend, enable=True)
    assert debugger._State.pdb is None and debugger._State.debugpy is None


def test_a_port_given_as_text_reads_as_the_variable_does():
    endpoint = breakpod.init_remote_debugger(port="0", backend="pdb", enable=True)
    assert endpoint is not None and endpoint.port > 0
