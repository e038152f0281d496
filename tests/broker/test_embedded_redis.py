"""The embedded redis-server's lifecycle: one per data directory, nothing left
behind by a failed start, a stale server on the directory stopped first."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from breakpod_broker import redis_server
from breakpod_broker.errors import RedisServerError
from breakpod_broker.redis_server import EmbeddedRedis, find_binary, free_port, repair_aof, serves
from tests.brokerkit import wait_until
from tests.chaos.kit import EmbeddedBroker, redis_servers
from tests.valkey_aof import REDIS_7_CASES, cut_in_a_transaction, resp, valkey_as_redis_server


def test_one_server_per_data_directory(tmp_path):
    with EmbeddedRedis(tmp_path) as first:
        with pytest.raises(RedisServerError, match="in use by another broker"):
            EmbeddedRedis(tmp_path).start()
        assert redis_servers(tmp_path) == [first.proc.pid]
    assert not redis_servers(tmp_path)


def test_a_stale_server_on_the_data_directory_is_stopped_before_a_start(tmp_path):
    args = [find_binary(), "--port", str(free_port()), "--bind", "127.0.0.1"]
    stale = subprocess.Popen([*args, "--dir", str(tmp_path), "--save", ""], cwd=tmp_path)
    try:
        wait_until(lambda: serves(stale.pid, tmp_path))
        (tmp_path / "redis.pid").write_text(f"{stale.pid}\n")
        with EmbeddedRedis(tmp_path) as server:
            assert stale.wait(15) is not None
            assert redis_servers(tmp_path) == [server.proc.pid]
    finally:
        stale.kill()
        stale.wait(10)


@pytest.mark.timeout(120)
def test_a_stop_while_the_supervisor_restarts_the_server_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    """stop() takes the server's process from another thread at any moment, the
    supervisor's restart included: the supervisor must neither fail (it raised on the
    process stop() had taken) nor leave a server it started behind."""
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    monkeypatch.setattr(redis_server, "RESTART_DELAYS", (0.0,))
    for attempt in range(12):
        data = tmp_path / str(attempt)
        server = EmbeddedRedis(data).start()
        assert server.proc is not None
        server.proc.kill()  # the supervisor starts another at once
        time.sleep(attempt * 0.01)  # stop at a different point of that restart each time
        server.stop()
        assert not redis_servers(data), attempt
    assert failures == []


@pytest.mark.timeout(60)
def test_a_broker_that_fails_at_start_up_leaves_no_server_behind(tmp_path):
    broker = EmbeddedBroker(tmp_path / "data", tmp_path / "log", BREAKPOD_TOKENS_FILE="/nope")
    with pytest.raises(AssertionError, match="broker did not start"):
        broker.start()
    assert broker.proc is not None and broker.proc.wait(15) != 0
    assert "cannot read tokens file" in (tmp_path / "log").read_text()
    assert not redis_servers(tmp_path / "data")


@pytest.mark.timeout(60)
def test_a_second_broker_on_one_data_directory_refuses_clearly(tmp_path):
    first = EmbeddedBroker(tmp_path / "data", tmp_path / "log1").start()
    try:
        second = EmbeddedBroker(tmp_path / "data", tmp_path / "log2")
        with pytest.raises(AssertionError, match="in use by another broker"):
            second.start()
        assert len(redis_servers(tmp_path / "data")) == 1
        with first.client() as c:
            assert c.get("/healthz").json() == {"status": "ok"}
    finally:
        first.stop()
    assert not redis_servers(tmp_path / "data")


@pytest.mark.timeout(60)
def test_a_transaction_cut_by_a_kill_is_never_replayed(tmp_path):
    """A kill in the middle of writing a script's MULTI/EXEC block to the AOF: the
    half block must not load now, nor at the restart after later writes (where,
    left in the file, it replays inside them, or drops them)."""
    import redis

    with EmbeddedRedis(tmp_path) as server:
        redis.Redis.from_url(server.url).set("before", "1")
    aof = tmp_path / "appendonly.aof"
    with aof.open("ab") as f:  # the kill came while the block was being written
        f.write(resp("MULTI") + resp("SET", "half", "1") + resp("SET", "x", "y")[:-6])
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.get("half") is None
        client.set("after", "1")
        pid = server.proc.pid
        server.proc.kill()  # kill -9, and the supervisor restarts it on the same AOF
        wait_until(lambda: server.proc is not None and server.proc.pid != pid, timeout=20)
        wait_until(lambda: _answers(client), timeout=20)
        assert (client.get("before"), client.get("after"), client.get("half")) == (b"1", b"1", None)


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


WHOLE = resp("SET", "a", "1")


@pytest.mark.parametrize(
    ("tail", "kept"),
    [
        (resp("MULTI") + WHOLE, b""),  # stops inside a transaction
        (resp("MULTI") + WHOLE + resp("SET", "b", "2")[:-3], b""),  # ...inside its command
        (b"*3\r\n$", b""),  # stops inside a command's header
    ],
    ids=["in-multi", "in-multi-command", "in-header"],
)
def test_the_aof_check_cuts_only_a_damaged_end(tmp_path, tail, kept):
    aof = tmp_path / "appendonly.aof"
    aof.write_bytes(WHOLE + tail)
    repair_aof(tmp_path)
    assert aof.read_bytes() == WHOLE + kept


@pytest.mark.parametrize("case", REDIS_7_CASES)
def test_a_redis_7_layout_is_repaired_alike(tmp_path, monkeypatch, caplog, case):
    """A manifest's report points into the file that failed: its size comes from the
    report (a real Valkey 8 layout, checked by that server as redis-check-aof)."""
    valkey_as_redis_server(tmp_path / "bin", monkeypatch)
    make, reported = REDIS_7_CASES[case]
    incr, after = make(tmp_path / "data")
    before = incr.read_bytes()
    repair_aof(tmp_path / "data")
    assert incr.read_bytes() == (before if after is None else after)
    assert ("damaged" in caplog.text) == reported, caplog.text


def test_a_damaged_end_of_a_manifests_earlier_file_is_reported(tmp_path, monkeypatch, caplog):
    """Only a manifest's last file can be cut back (redis-check-aof refuses the others,
    and Redis then refuses to start): the log says so."""
    valkey_as_redis_server(tmp_path / "bin", monkeypatch)
    incr, _ = cut_in_a_transaction(tmp_path / "data", into_last_command=True)
    later = incr.with_name("appendonly.aof.2.incr.aof")
    later.write_bytes(WHOLE)
    manifest = incr.with_name("appendonly.aof.manifest")
    manifest.write_text(manifest.read_text() + f"file {later.name} seq 2 type i\n")
    before = incr.read_bytes()
    repair_aof(tmp_path / "data")
    assert incr.read_bytes() == before and later.read_bytes() == WHOLE
    assert "damaged and could not be cut back" in caplog.text, caplog.text


@pytest.mark.parametrize(
    "damaged",
    [
        # an orphaned MULTI from an older crash, then a whole transaction and more writes:
        # cutting at the orphan would drop every write after it
        WHOLE + resp("MULTI") + WHOLE + resp("MULTI") + WHOLE + resp("EXEC") + WHOLE * 20,
        b"file appendonly.aof.1.base.rdb seq 1 type b\n",  # not an AOF this tool reads
    ],
    ids=["orphan-multi-inside", "foreign-format"],
)
def test_the_aof_check_leaves_damage_before_the_end_alone(tmp_path, damaged):
    aof = tmp_path / "appendonly.aof"
    aof.write_bytes(damaged)
    repair_aof(tmp_path)
    assert aof.read_bytes() == damaged


@pytest.mark.timeout(60)
def test_a_broker_that_answers_too_late_is_stopped_with_its_server(tmp_path):
    """A start that gives up must not leave the broker (and its redis-server) running:
    five brokers outlived a loaded run by an hour."""
    broker = EmbeddedBroker(tmp_path / "data", tmp_path / "log")
    with pytest.raises(AssertionError, match="broker did not start"):
        broker.start(timeout=0.01)  # gives up before any broker could answer
    assert broker.proc is not None and broker.proc.poll() is not None
    assert wait_until(lambda: not redis_servers(tmp_path / "data"), timeout=15)
