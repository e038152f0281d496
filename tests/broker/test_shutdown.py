"""The broker's shutdown is bounded, under load: SIGTERM gives it
``BREAKPOD_SHUTDOWN_SECONDS``; a broker still running then, or sent a second
SIGTERM, stops its embedded redis-server and exits 1 saying why. Nothing is left
behind: not the broker, not its redis-server (which, reparented to PID 1, would
hold its data directory for ever).

The shutdown that cannot finish is a real one: the embedded redis-server is
frozen with SIGSTOP, as a server stuck on a full disk or a starved node is, while
followers stream events and agents long-poll for commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from breakpod import protocol
from breakpod_broker.redis_server import free_port, serves
from tests.brokerkit import AGENT, TOKENS, VIEWER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


class EmbeddedBroker:
    """``breakpod-broker serve`` with its embedded redis-server, and agents and
    followers keeping it busy until it stops."""

    def __init__(self, tmp_path: Path, shutdown_seconds: float) -> None:
        self.data = tmp_path / "data"
        self.log = tmp_path / "broker.log"
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
        env.update(BREAKPOD_BROKER_TOKENS=TOKENS, BREAKPOD_SHUTDOWN_SECONDS=str(shutdown_seconds))
        argv = [sys.executable, "-m", "breakpod_broker.cli", "serve", "--data-dir", str(self.data)]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [*argv, "--port", self.url.rsplit(":", 1)[1]],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.stop_load = threading.Event()
        self._wait_ready()
        self.redis_pid = int((self.data / "redis" / "redis.pid").read_text())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the broker did not start:\n{self.log.read_text()}")

    def load(self, agents: int = 8, followers: int = 4) -> None:
        """Agents that post events and long-poll for commands, and SSE followers."""
        for n in range(agents):
            threading.Thread(target=self._agent, args=(f"load-{n}",), daemon=True).start()
        for _ in range(followers):
            threading.Thread(target=self._follow, daemon=True).start()
        time.sleep(1.0)  # every client connected and waiting

    def _agent(self, session: str) -> None:
        with httpx.Client(base_url=self.url, headers=_auth(AGENT), timeout=5) as c:
            while not self.stop_load.is_set():
                try:
                    c.put(protocol.session_path(session), json={"host": "load"})
                    event = {"id": os.urandom(8).hex(), "session": session, "kind": "log"}
                    c.post(protocol.EVENTS, json={"events": [{**event, "time": time.time()}]})
                    c.get(protocol.commands_path(session), params={"wait": 3})
                except httpx.HTTPError:
                    time.sleep(0.05)

    def _follow(self) -> None:
        while not self.stop_load.is_set():
            try:
                with httpx.stream(
                    "GET", f"{self.url}{protocol.EVENTS_STREAM}", headers=_auth(VIEWER), timeout=5
                ) as response:
                    for _ in response.iter_lines():
                        if self.stop_load.is_set():
                            return
            except httpx.HTTPError:
                time.sleep(0.05)

    def freeze_redis(self) -> None:
        os.kill(self.redis_pid, signal.SIGSTOP)

    def redis_alive(self) -> bool:
        return serves(self.redis_pid, (self.data / "redis").resolve())

    def exit_within(self, seconds: float) -> int:
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the broker still runs {seconds}s on:\n{self.log.read_text()[-3000:]}"
            ) from None

    def close(self) -> None:
        self.stop_load.set()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.redis_alive():
            os.kill(self.redis_pid, signal.SIGCONT)
            os.kill(self.redis_pid, signal.SIGKILL)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[object]:
    started: list[EmbeddedBroker] = []

    def start(shutdown_seconds: float) -> EmbeddedBroker:
        started.append(EmbeddedBroker(tmp_path, shutdown_seconds))
        return started[-1]

    yield start
    for broker in started:
        broker.close()


def test_a_shutdown_past_its_deadline_stops_redis_and_exits_1_saying_why(embedded) -> None:
    broker = embedded(shutdown_seconds=2)
    broker.load()
    broker.freeze_redis()
    began = time.monotonic()
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.exit_within(15) == 1
    assert time.monotonic() - began < 9  # the deadline, then redis: ~2 s of SIGTERM, SIGKILL
    said = broker.log.read_text()
    assert "the shutdown after SIGTERM took longer than 2s" in said
    assert "stopped its embedded redis-server and exits 1" in said
    assert not broker.redis_alive()


def test_a_second_sigterm_is_never_ignored(embedded) -> None:
    broker = embedded(shutdown_seconds=60)
    broker.load()
    broker.freeze_redis()
    broker.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert broker.proc.poll() is None  # still shutting down: the frozen Redis holds it
    began = time.monotonic()
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.exit_within(15) == 1
    assert time.monotonic() - began < 7
    assert "a second SIGTERM before the shutdown finished" in broker.log.read_text()
    assert not broker.redis_alive()


def test_sigterms_in_a_row_under_load_end_the_broker_and_its_redis(embedded) -> None:
    broker = embedded(shutdown_seconds=10)
    broker.load(agents=16, followers=8)
    began = time.monotonic()
    while broker.proc.poll() is None and time.monotonic() - began < 20:
        broker.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    assert broker.exit_within(1) in (1, -signal.SIGTERM)
    assert time.monotonic() - began < 15
    assert not broker.redis_alive()
    assert "Traceback" not in broker.log.read_text()
