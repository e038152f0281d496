"""kill -9 of redis-server and of the broker while an agent ingests, with the
embedded Redis and with an external one: every acknowledged event is still
there afterwards, no redis-server is left without its broker, and no read
answers 5xx. ``CHAOS_ROUNDS`` kills per test (``make chaos``: 20)."""

from __future__ import annotations

import collections
import time

import pytest

from breakpod_broker.redis_server import EmbeddedRedis
from tests.brokerkit import wait_until
from tests.chaos.kit import (
    ROUNDS,
    EmbeddedBroker,
    Ingester,
    kill9,
    redis_servers,
    register,
    server_errors_after,
    stored_ids,
)
from tests.valkey_aof import valkey_as_redis_server

LIMIT = pytest.mark.timeout(90 + 30 * ROUNDS)


def _ingest_through(broker_url: str, fault, rounds: int = ROUNDS) -> Ingester:
    """Ingest, inject ``fault`` ``rounds`` times mid-ingest, check after each round."""
    register(broker_url, "chaos")
    ingester = Ingester(broker_url, "chaos")
    ingester.start()
    try:
        for n in range(rounds):
            ingester.wait_for(200)
            fault(n)
            ingester.wait_for(200, timeout=60)  # acknowledged again after the fault
            assert not ingester.errors, ingester.errors[:5]
    finally:
        ingester.stop()
    stored = stored_ids(broker_url)
    lost = set(ingester.acked) - set(stored)
    assert not lost, f"{len(lost)} of {len(ingester.acked)} acknowledged events lost"
    twice = [i for i, n in collections.Counter(stored).items() if n > 1]
    assert not twice, f"stored twice (the ids deduplicate): {twice[:10]}"
    assert not server_errors_after(broker_url, "chaos")
    return ingester


@LIMIT
@pytest.mark.parametrize("server", ["redis-6.2", "valkey-8"])
def test_embedded_redis_killed_mid_ingest_is_restarted_and_loses_nothing(
    tmp_path, monkeypatch, server
):
    """Redis 6.2 keeps one AOF file; Valkey 8 (as Redis 7) a manifest and its files."""
    if server == "valkey-8":
        valkey_as_redis_server(tmp_path / "bin", monkeypatch)
    broker = EmbeddedBroker(tmp_path / "data", tmp_path / "broker.log").start()
    try:

        def fault(n: int) -> None:
            before = broker.redis_pid()
            kill9(before)
            wait_until(lambda: broker.redis_pid() != before, timeout=30)
            with broker.client() as c:
                wait_until(lambda: c.get("/healthz").status_code == 200, timeout=30)
            assert redis_servers(tmp_path / "data") == [broker.redis_pid()]

        _ingest_through(broker.url, fault)
    finally:
        broker.stop()
    assert wait_until(lambda: not redis_servers(tmp_path / "data"), timeout=15) is not None
    manifests = list((tmp_path / "data").rglob("appendonly.aof.manifest"))
    assert bool(manifests) == (server == "valkey-8")


@LIMIT
def test_broker_killed_mid_ingest_leaves_no_redis_behind_and_loses_nothing(tmp_path):
    data = tmp_path / "data"
    broker = EmbeddedBroker(data, tmp_path / "broker.log").start()
    orphans: list[int] = []
    try:

        def fault(n: int) -> None:
            assert broker.proc is not None
            kill9(broker.proc.pid)
            broker.proc.wait(10)
            deadline = time.monotonic() + 15
            while redis_servers(data) and time.monotonic() < deadline:
                time.sleep(0.05)
            orphans.extend(redis_servers(data))
            broker.start()
            assert len(redis_servers(data)) == 1

        _ingest_through(broker.url, fault)
    finally:
        broker.stop()
    assert not orphans, f"redis-server left running after kill -9 of its broker: {orphans}"


@LIMIT
def test_external_redis_killed_mid_ingest_loses_nothing(tmp_path, start_broker):
    # an external Redis configured as the README asks: appendonly, appendfsync always
    with EmbeddedRedis(tmp_path / "redis") as server:
        broker = start_broker(redis=server.url)

        def fault(n: int) -> None:
            before = server.proc.pid if server.proc else 0
            kill9(before)
            wait_until(lambda: server.running and server.proc and server.proc.pid != before, 30)
            with broker.client() as c:
                wait_until(lambda: c.get("/readyz").status_code == 200, timeout=30)

        _ingest_through(broker.url, fault)


@LIMIT
def test_broker_killed_mid_ingest_with_external_redis_loses_nothing(tmp_path, start_broker):
    with EmbeddedRedis(tmp_path / "redis") as server:
        broker = start_broker(redis=server.url)

        def fault(n: int) -> None:
            assert broker.proc is not None
            kill9(broker.proc.pid)
            broker.proc.wait(10)
            broker.start()

        _ingest_through(broker.url, fault)
