"""Fault-injection helpers: brokers with an embedded Redis, a retrying ingester
that records what the broker acknowledged, and the checks that follow a fault."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from breakpod_broker.redis_server import serves
from tests.brokerkit import AGENT, TOKENS, VIEWER, BrokerProcess, wait_until

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "2"))


class EmbeddedBroker(BrokerProcess):
    """``breakpod-broker serve --data-dir D``: a broker with its own supervised redis-server."""

    def __init__(self, data_dir: Path, log_path: Path, **env: str) -> None:
        super().__init__("", log_path, **env)
        self.data_dir = data_dir

    def start(self, timeout: float = 30.0) -> EmbeddedBroker:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
        env.update(BREAKPOD_BROKER_TOKENS=TOKENS, **self.env)
        cmd = [sys.executable, "-m", "breakpod_broker.cli", "--log-level", "warning", "serve"]
        cmd += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self._wait_ready(timeout)
        return self

    def redis_pid(self, timeout: float = 10.0) -> int:
        """The embedded server's pid; a restart rewrites the file, so an empty read is retried."""
        pidfile = self.data_dir / "redis" / "redis.pid"
        return wait_until(lambda: _read_pid(pidfile), timeout=timeout)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text())
    except (OSError, ValueError):
        return None


def redis_servers(data_dir: Path) -> list[int]:
    """Pids of live redis-server processes working in ``data_dir`` or below it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and any(
            serves(int(entry.name), d) for d in (data_dir.resolve(), data_dir.resolve() / "redis")
        ):
            found.append(int(entry.name))
    return found


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


class Ingester(threading.Thread):
    """Posts batches of fresh events as fast as it can, retrying a batch until the
    broker answers 200 (the agent's emitter does the same); records every id the
    broker acknowledged and every 5xx other than 503 (Redis away, retry later)."""

    def __init__(self, url: str, session: str, batch: int = 20) -> None:
        super().__init__(daemon=True)
        self.url, self.session, self.batch = url, session, batch
        self.acked: list[str] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self._next = 0

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {AGENT}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=15) as client:
            while not self.stopping.is_set():
                ids = [f"{self.session}-{self._next + i}" for i in range(self.batch)]
                self._next += self.batch
                self._deliver(client, ids)

    def _deliver(self, client: httpx.Client, ids: list[str]) -> None:
        events = [{"id": i, "session": self.session, "kind": "log", "fields": {}} for i in ids]
        while not self.stopping.is_set():
            try:
                response = client.post("/v1/events", json={"events": events})
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if response.status_code == 200:
                self.acked += ids
                return
            if response.status_code >= 500 and response.status_code != 503:
                self.errors.append(f"{response.status_code}: {response.text[:200]}")
            time.sleep(0.05)

    def wait_for(self, more: int, timeout: float = 30.0) -> None:
        """Until ``more`` further events were acknowledged."""
        target = len(self.acked) + more
        wait_until(lambda: len(self.acked) >= target or self.errors, timeout)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


def stored_ids(url: str, patience: float = 30.0) -> list[str]:
    """Every event id in the broker's global stream, read page by page, in order. A 503
    ("Redis is unavailable; retry later": a pooled connection from before the last
    kill meets the restarted Redis) is retried, as the broker asks, for ``patience``."""
    found: list[str] = []
    since = "0"
    deadline = time.monotonic() + patience
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {VIEWER}"}) as c:
        while True:
            response = c.get("/v1/events", params={"since": since, "limit": 1000}, timeout=30)
            if response.status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            assert response.status_code == 200, response.text
            page = response.json()
            found += [e["id"] for e in page["events"]]
            if not page["events"]:
                return found
            since = page["cursor"]


def server_errors_after(url: str, session: str) -> list[str]:
    """5xx answers from every read an engineer would make after the fault."""
    paths = ["/healthz", "/readyz", "/v1/sessions", f"/v1/sessions/{session}", "/v1/events"]
    paths += [f"/v1/events?session={session}", f"/v1/sessions/{session}/attach", "/metrics"]
    errors = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {VIEWER}"}) as c:
        for path in paths:
            response = c.get(path, timeout=15)
            if response.status_code >= 500:
                errors.append(f"{path}: {response.status_code} {response.text[:200]}")
    return errors


def register(url: str, session: str) -> Any:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {AGENT}"}) as c:
        response = c.put(f"/v1/sessions/{session}", json={"job": "chaos"}, timeout=15)
        assert response.status_code == 200, response.text
        return response.json()
