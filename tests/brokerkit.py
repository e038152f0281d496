"""Fixtures for broker tests: a real redis-server and real broker processes.

Imported by tests/broker/conftest.py and tests/agent/conftest.py. The Redis
server is session-scoped and flushed before each test (as arq and rq do).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from breakpod_broker.redis_server import EmbeddedRedis, free_port

ADMIN = "admin-token-0001"
AGENT = "agent-token-0001"
AGENT2 = "agent-token-0002"
VIEWER = "viewer-token-001"
TOKENS = f"admin:{ADMIN},agent:{AGENT},agent:{AGENT2},viewer:{VIEWER}"


class BrokerProcess:
    """``breakpod-broker serve`` in a child process on a free 127.0.0.1 port."""

    def __init__(self, redis_url: str, log_path: Path, port: int = 0, **env: str) -> None:
        self.redis_url = redis_url
        self.port = port or free_port()
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 45.0) -> BrokerProcess:  # a loaded machine: 20 s ran out
        env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
        env.update(BREAKPOD_BROKER_TOKENS=TOKENS, BREAKPOD_METRICS_CACHE_SECONDS="0")
        env.update(self.env)
        cmd = [sys.executable, "-m", "breakpod_broker.cli", "--log-level", "warning", "serve"]
        cmd += ["--port", str(self.port), "--redis-url", self.redis_url]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self._end()  # one that answers too late must not outlive the test
        raise AssertionError(f"broker did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self._end()
        self.proc = None

    def _end(self) -> None:
        """SIGTERM (an embedded broker stops its redis-server), then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def _flushed(server: EmbeddedRedis) -> str:
    import redis

    with redis.Redis.from_url(server.url) as r:
        r.flushall()
    return server.url


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """The shared real Redis, flushed for this test (the brokers a test starts use it)."""
    return _flushed(redis_server)


@pytest.fixture(scope="session")
def _shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the session, on a Redis server of its own: it lives on through
    every later test, and on the same server its sweepers (deaths, notifier jobs) would
    claim work off the brokers a test starts with settings of its own, and its
    subscriptions would count as theirs (pub/sub spans a server's databases)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("shared-redis")).start()
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    broker = BrokerProcess(server.url, log).start()
    yield broker
    broker.stop()
    server.stop()


@pytest.fixture
def broker(_shared_broker: BrokerProcess) -> BrokerProcess:
    """A running broker process on its own (flushed) Redis; ``broker.redis_url`` reaches it."""
    import redis

    with redis.Redis.from_url(_shared_broker.redis_url) as r:
        r.flushall()
    return _shared_broker


@pytest.fixture
def start_broker(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    """start_broker(**env) -> another broker process on the same Redis; stopped at teardown."""
    started: list[BrokerProcess] = []

    def _start(redis: str | None = None, port: int = 0, **env: str) -> BrokerProcess:
        log = tmp_path / f"broker{len(started)}.log"
        broker = BrokerProcess(redis or redis_url, log, port, **env).start()
        started.append(broker)
        return broker

    yield _start
    for broker in started:
        broker.stop()


def register(
    broker: BrokerProcess, session_id: str, token: str = AGENT, **fields: Any
) -> dict[str, Any]:
    with broker.client(token) as c:
        response = c.put(f"/v1/sessions/{session_id}", json=fields)
        assert response.status_code == 200, response.text
        return dict(response.json())


def post_events(
    broker: BrokerProcess, *events: dict[str, Any], token: str = AGENT
) -> httpx.Response:
    with broker.client(token) as c:
        return c.post("/v1/events", json={"events": list(events)})


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


class Follower(threading.Thread):
    """A viewer reading /v1/events/stream in a thread: ``events`` as they come."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[dict] = []
        self.ready = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {VIEWER}"}
        try:
            with (
                httpx.Client(base_url=self.url, timeout=30) as c,
                c.stream("GET", "/v1/events/stream", headers=headers) as response,
            ):
                self.ready.set()
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(json.loads(line[5:]))
        except httpx.HTTPError:
            pass  # the broker stopped at teardown


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 in a thread (a server that is not the broker): its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
