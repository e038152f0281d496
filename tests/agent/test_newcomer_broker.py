"""A newcomer's broker: `serve --dev` keeps its tokens and prints the exports for both
sides; a bad setting is one line naming it (exit 2) and starts nothing; a silent
session reads `lost (no heartbeat)`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from breakpod_broker.redis_server import free_port
from tests.agent.test_attach_cli import run_cli
from tests.agent.test_breakpoint import SCRIPT
from tests.brokerkit import register, wait_until

BROKER = [sys.executable, "-m", "breakpod_broker.cli", "serve"]
EXPORT = re.compile(r"for the (job|CLI):\s+export BREAKPOD_BROKER_URL=(\S+) (BREAKPOD_\w+)=(\S+)")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    return {**env, **extra}


def redis_servers_on(data_dir: Path) -> list[str]:
    """redis-server processes whose command line names this data directory."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "redis-server" in cmdline and str(data_dir) in cmdline:
            found.append(proc.name)
    return found


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"BREAKPOD_BROKER_TOKENS": "admin:short"}, "BREAKPOD_BROKER_TOKENS"),
        ({"BREAKPOD_BROKER_PORT": "70000"}, "BREAKPOD_BROKER_PORT"),
        ({"BREAKPOD_NOTIFIERS": "{not json"}, "BREAKPOD_NOTIFIERS"),
        ({"BREAKPOD_MAX_BATCH": "0"}, "BREAKPOD_MAX_BATCH"),
        ({"BREAKPOD_TLS_CERT_FILE": "/nonexistent/cert.pem"}, "BREAKPOD_TLS_CERT_FILE"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_nothing_starts(tmp_path, env, named):
    data = tmp_path / "data"
    result = subprocess.run(
        [*BROKER, "--data-dir", str(data)],
        env=clean_env(**{"BREAKPOD_BROKER_PORT": str(free_port()), **env}),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # no lifespan traceback
    assert result.stderr.startswith(f"breakpod-broker: error: {named}")
    assert not (data / "redis").exists() and redis_servers_on(data) == []


class DevBroker:
    """`breakpod-broker serve --dev` with an embedded Redis in ``data``."""

    def __init__(self, data: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [*BROKER, "--dev", "--data-dir", str(data), "--port", str(self.port)],
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        wait_until(self._ready, timeout=45, interval=0.1)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def exports(self) -> dict[str, dict[str, str]]:
        found = EXPORT.findall(self.log.read_text())
        return {side: {"BREAKPOD_BROKER_URL": url, var: token} for side, url, var, token in found}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.mark.timeout(180)
def test_dev_tokens_survive_a_restart_and_the_exports_work_for_both_sides(tmp_path, spawn):
    data = tmp_path / "data"
    first = DevBroker(data, tmp_path / "first.log")
    try:
        exports = first.exports()
        assert set(exports) == {"job", "CLI"}
        job, cli = exports["job"], exports["CLI"]
        assert "BREAKPOD_AGENT_TOKEN" in job and "BREAKPOD_BROKER_TOKEN" in cli
        stat = (data / "dev-tokens.json").stat()
        assert stat.st_mode & 0o077 == 0  # the owner's only
    finally:
        first.stop()
    second = DevBroker(data, tmp_path / "second.log")
    try:
        assert second.exports()["job"]["BREAKPOD_AGENT_TOKEN"] == job["BREAKPOD_AGENT_TOKEN"]
        assert "reused from" in second.log.read_text()
        url = f"http://127.0.0.1:{second.port}"
        child = spawn(
            SCRIPT,  # parks: registers its session with the reused agent token
            env={**job, "BREAKPOD_BROKER_URL": url},
            stdin="closed",
        )
        cli_env = {**cli, "BREAKPOD_BROKER_URL": url}
        listed = wait_until(
            lambda: json.loads(run_cli("sessions", "--json", env=cli_env).stdout or "[]"),
            timeout=30,
        )
        assert listed and "refused" not in child.stderr
        child.proc.kill()
    finally:
        second.stop()


def test_a_silent_session_reads_lost_no_heartbeat(start_broker):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="1")
    register(broker, "train-silent-1", pid=1)
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_BROKER_TOKEN": "viewer-token-001"}

    def lost_row() -> str | None:
        table = run_cli("sessions", env=env).stdout
        row = next((line for line in table.splitlines() if "train-silent-1" in line), "")
        return row if " lost " in row else None

    row = wait_until(lost_row, timeout=30, interval=0.3)
    assert "no heartbeat" in row
