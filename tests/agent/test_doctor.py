"""``breakpod doctor``: a real CLI process without a TTY, and a real HTTP broker stand-in."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from breakpod._cli import doctor
from tests.brokerkit import http_server

QUIET = {"BREAKPOD_BROKER_URL": "", "KUBERNETES_SERVICE_HOST": "", "CI": "", "GITHUB_ACTIONS": ""}


def run_doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``breakpod doctor`` with stdin closed, as in a container or CI job."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    base.pop("PYTHONBREAKPOINT", None)
    cmd = ["/bin/sh", "-c", 'exec "$@" <&-', "sh", sys.executable, "-m", "breakpod._cli.main"]
    return subprocess.run(
        [*cmd, "doctor", *args],
        env={**base, **QUIET, "BREAKPOD_PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def line(output: str, name: str) -> str:
    """The check's line plus its fix line, if any."""
    lines = output.splitlines()
    i = next(i for i, text in enumerate(lines) if text[6:].startswith(name + " "))
    fix = lines[i + 1] if i + 1 < len(lines) and "fix:" in lines[i + 1] else ""
    return lines[i] + "\n" + fix


def test_headless_doctor_flags_the_tty_and_explains_the_park():
    result = run_doctor(
        env={"PYTHONBREAKPOINT": "breakpod.set_trace", "BREAKPOD_HOLD_SECONDS": "90"}
    )
    stdin = line(result.stdout, "stdin")
    assert stdin.startswith("warn") and "not a TTY (headless)" in stdin
    assert "breakpoint() will park on a socket at 127.0.0.1" in stdin and "up to 90s" in stdin
    assert "fix: attach with: breakpod attach 127.0.0.1" in stdin
    assert line(result.stdout, "PYTHONBREAKPOINT").startswith("ok")
    assert result.returncode == 0, result.stdout
    assert "nothing blocks attaching" in result.stdout


def test_non_loopback_bind_without_token_fails_with_the_fix():
    result = run_doctor(env={"BREAKPOD_HOST": "0.0.0.0"})
    bind = line(result.stdout, "bind")
    assert bind.startswith("FAIL") and "0.0.0.0 is not loopback and no token is set" in bind
    assert "fix: set BREAKPOD_LISTENER_TOKEN=<secret>" in bind
    assert result.returncode == 1
    assert "1 problem(s) block attaching" in result.stdout


def test_json_output_and_a_token_make_the_bind_a_warning():
    env = {
        "BREAKPOD_HOST": "0.0.0.0",
        "BREAKPOD_LISTENER_TOKEN": "s3cret-token",
        "BREAKPOD_BACKEND": "pdb",
    }
    result = run_doctor("--json", env=env)
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["bind"]["status"] == "warn" and "token set" in checks["bind"]["found"]
    assert checks["torch"]["status"] == "ok"
    assert checks["torch.compile"]["status"] == "warn"
    assert result.returncode == 0


def test_auto_backend_warns_that_init_remote_debugger_would_pick_debugpy():
    result = run_doctor(env={"BREAKPOD_HOST": "0.0.0.0", "BREAKPOD_LISTENER_TOKEN": "s3cret-token"})
    bind = line(result.stdout, "bind")
    assert bind.startswith("warn") and "picks debugpy" in bind and "BREAKPOD_BACKEND=pdb" in bind


# -- single checks, in process --------------------------------------------------------


def checks(env: dict[str, str], check: doctor.Checker) -> list[doctor.Check]:
    return list(check(doctor.Context(env, tty=False)))


def test_headless_without_the_shim_says_breakpoint_would_die():
    [stdin] = checks({}, doctor.check_tty)
    assert stdin.status == "warn" and "a plain breakpoint() fails here" in stdin.found
    assert stdin.fix.startswith("export PYTHONBREAKPOINT=breakpod.set_trace")


def test_bad_setting_fails():
    [bad] = checks({"BREAKPOD_HOLD_SECONDS": "soon"}, doctor.check_settings)
    assert bad.status == "FAIL" and "BREAKPOD_HOLD_SECONDS='soon'" in bad.found
    assert doctor.exit_status([bad]) == 1


def test_busy_port_is_a_warning_with_a_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        [result] = checks({"BREAKPOD_PORT": str(port)}, doctor.check_port)
    assert result.status == "warn" and "in use" in result.found and "BREAKPOD_PORT" in result.fix


def test_compile_disabled_is_ok():
    env = {"TORCH_COMPILE_DISABLE": "1"}
    assert doctor._compile(doctor.Context(env, tty=False)).status == "ok"


def test_kubernetes_with_downward_api_env_names_the_pod():
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "train-0", "POD_NAMESPACE": "ml"}
    found = {c.name: c for c in checks(env, doctor.check_hosting)}
    assert found["kubernetes"].status == "ok" and "ml/train-0" in found["kubernetes"].found
    bare = {
        c.name: c for c in checks({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, doctor.check_hosting)
    }
    assert bare["kubernetes"].status == "warn" and "POD_NAME" in bare["kubernetes"].fix


class Broker(http.server.BaseHTTPRequestHandler):
    token = "good"

    def do_GET(self) -> None:
        authorized = self.headers.get("Authorization") == f"Bearer {self.token}"
        self.send_response(200 if self.path == "/healthz" or authorized else 401)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def broker_url() -> Iterator[str]:
    with http_server(Broker) as url:
        yield url


def test_broker_reachable_and_token_accepted(broker_url):
    assert doctor.broker_check(broker_url, "good").status == "ok"


def test_broker_rejects_the_token(broker_url):
    result = doctor.broker_check(broker_url, "wrong")
    assert result.status == "FAIL" and "rejected the token" in result.found
    assert "BREAKPOD_AGENT_TOKEN" in result.fix


def test_broker_without_token(broker_url):
    result = doctor.broker_check(broker_url, None)
    assert result.status == "FAIL" and "no token" in result.found


def test_unreachable_broker_fails():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        result = doctor.broker_check(f"http://127.0.0.1:{port}", "good")
    assert result.status == "FAIL" and "unreachable" in result.found


def test_tty_with_enable_remote_debug_still_parks():
    env = {"PYTHONBREAKPOINT": "breakpod.set_trace", "ENABLE_REMOTE_DEBUG": "1"}
    [stdin] = list(doctor.check_tty(doctor.Context(env, tty=True)))
    assert stdin.status == "ok" and "ENABLE_REMOTE_DEBUG=1: breakpoint() will park" in stdin.found
    [local] = list(doctor.check_tty(doctor.Context({}, tty=True)))
    assert "opens pdb on this terminal" in local.found


def test_a_bad_yes_no_value_the_job_reads_is_a_warning_naming_it():
    result = run_doctor(env={"BREAKPOD_MONITOR": "maybe", "BREAKPOD_REPLAY": "sure"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("warn  settings")]
    assert len(lines) == 2, result.stdout
    assert "BREAKPOD_MONITOR='maybe' is not a boolean" in lines[0] and "ignores it" in lines[0]
    assert "BREAKPOD_REPLAY='sure'" in lines[1]


@pytest.mark.parametrize(("backend", "status"), [("auto", doctor.WARN), ("debugpy", doctor.FAIL)])
def test_debugpy_under_a_required_token_is_said_before_any_listener_refuses(backend, status):
    """init_remote_debugger() refuses debugpy where the token is required; doctor said ok."""
    pytest.importorskip("debugpy")
    env = {"BREAKPOD_REQUIRE_TOKEN": "1", "BREAKPOD_LISTENER_TOKEN": "s3cret-token"}
    [bind] = checks({**env, "BREAKPOD_BACKEND": backend}, doctor.check_bind)
    assert bind.status == status and "debugpy" in bind.found and "BACKEND=pdb" in bind.fix
