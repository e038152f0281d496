"""The broker against a real Redis Cluster: three redis-server nodes in cluster mode
(the binary the embedded mode uses), slots assigned by ``redis-cli --cluster create``.

The whole API flow runs through it: register, heartbeat, events (deduplicated,
state changes), listing, commands long-polled and acknowledged, SSE; and the
keys land on more than one node, so the multi-slot paths really run."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from breakpod_broker import keys
from breakpod_broker.redis_server import find_binary, free_port
from tests.brokerkit import ADMIN, AGENT, VIEWER, BrokerProcess, Follower, wait_until

NODES = 3


BUS_OFFSET = 10000  # a node's cluster bus listens on its port + this
MAX_CLUSTER_PORT = 65535 - BUS_OFFSET
TRIES = 3  # a node whose port or bus port was taken between the check and its bind


def cluster_port() -> int:
    """A free port whose cluster bus port is free too (a bus port taken by another test's
    socket made a node abort: "Could not create server TCP listening socket")."""

    def both_free() -> int:
        port = free_port()
        return port if port <= MAX_CLUSTER_PORT and _bindable(port + BUS_OFFSET) else 0

    return wait_until(both_free, timeout=5)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisClusterNodes:
    """Three loopback redis-server processes in cluster mode, each in its own folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = [cluster_port() for _ in range(NODES)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisClusterNodes:
        server = find_binary()
        cli = Path(server).with_name("redis-cli")
        if not cli.is_file():
            pytest.skip(f"no redis-cli next to {server} to assign the cluster's slots")
        for i in range(NODES):
            self.procs.append(self._node(i, server))
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [str(cli), "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=True,
            timeout=60,
        )
        wait_until(self._ready, timeout=30, interval=0.2)
        return self

    def _node(self, i: int, server: str) -> subprocess.Popen[bytes]:
        """Node ``i`` up and answering; on a port taken meanwhile, again on another."""
        for _ in range(TRIES):
            port = self.ports[i]
            folder = self.root / str(port)
            folder.mkdir()
            argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            argv += ["--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no"]
            argv += ["--logfile", str(folder / "redis.log")]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            wait_until(lambda p=proc, n=port: p.poll() is not None or _pings(n), timeout=20)
            if proc.poll() is None:
                return proc
            self.ports[i] = cluster_port()
        log = (folder / "redis.log").read_text(errors="replace")[-800:]
        raise AssertionError(
            f"no redis cluster node started in {TRIES} tries; the last said:\n{log}"
        )

    def _ready(self) -> bool:
        for port in self.ports:
            with redis.Redis(port=port, decode_responses=True) as r:
                if r.cluster("info").get("cluster_state") != "ok":
                    return False
        return True

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _pings(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1) as r:
            return bool(r.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster")).start()
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def cluster_broker(redis_cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster-broker") / "broker.log"
    broker = BrokerProcess(redis_cluster.url, log).start(timeout=60)
    yield broker
    broker.stop()


def _event(event_id, session, kind="anomaly", **fields):
    return {"id": event_id, "session": session, "kind": kind, "fields": fields}


@pytest.mark.timeout(180)
def test_the_api_flow_runs_against_a_redis_cluster(redis_cluster, cluster_broker):
    sessions = [f"c{i}" for i in range(12)]
    follower = Follower(cluster_broker.url)
    follower.start()
    assert follower.ready.wait(20)
    with cluster_broker.client(AGENT) as agent:
        for i, session_id in enumerate(sessions):
            body = {"job": f"job-{i % 2}", "namespace": "team-a" if i % 3 else None}
            reply = agent.put(f"/v1/sessions/{session_id}", json=body)
            assert reply.status_code == 200, reply.text
            assert agent.post(f"/v1/sessions/{session_id}/heartbeat", json={}).status_code == 200
        # one batch over several sessions (several slots), a retry deduplicated, a state change
        batch = [_event(f"e-{s}", s, n=i) for i, s in enumerate(sessions)]
        batch.append(_event("parked-c0", "c0", "parked", address="127.0.0.1:4444"))
        first = agent.post("/v1/events", json={"events": batch})
        assert first.status_code == 200, first.text
        assert first.json()["accepted"] == len(batch)
        retry = agent.post("/v1/events", json={"events": batch[:3]})
        assert retry.json() == {"accepted": 0, "duplicates": 3, "cursors": [None] * 3}

    with cluster_broker.client(VIEWER) as viewer:
        c0 = viewer.get("/v1/sessions/c0").json()
        assert c0["state"] == "parked" and c0["address"] == "127.0.0.1:4444"
        listed = viewer.get("/v1/sessions", params={"limit": 5}).json()
        seen = [s["id"] for s in listed["sessions"]]
        while listed["next"]:
            listed = viewer.get(
                "/v1/sessions", params={"limit": 5, "cursor": listed["next"]}
            ).json()
            seen += [s["id"] for s in listed["sessions"]]
        assert sorted(seen) == sorted(sessions)
        job0 = viewer.get("/v1/sessions", params={"job": "job-0"}).json()["sessions"]
        assert sorted(s["id"] for s in job0) == sorted(sessions[::2])
        team = viewer.get("/v1/sessions", params={"namespace": "team-a"}).json()["sessions"]
        assert sorted(s["id"] for s in team) == sorted(s for i, s in enumerate(sessions) if i % 3)
        everything = viewer.get("/v1/events", params={"limit": 1000}).json()["events"]
        cursors = [e["cursor"] for e in everything]
        assert len(set(cursors)) == len(batch)  # each event once, retry dropped
        own = viewer.get("/v1/events", params={"session": "c3"}).json()["events"]
        assert [e["id"] for e in own] == ["e-c3"]
        assert own[0]["cursor"] in cursors  # one cursor in both streams

    got: dict[str, list[str]] = {}

    def poll(session_id: str) -> None:
        with cluster_broker.client(AGENT) as agent:
            reply = agent.get(f"/v1/sessions/{session_id}/commands", params={"wait": 30})
            got[session_id] = [c["id"] for c in reply.json()["commands"]]
            for command_id in got[session_id]:
                ack = agent.post(f"/v1/sessions/{session_id}/commands/{command_id}/ack", json={})
                assert ack.status_code == 200, ack.text

    polls = [threading.Thread(target=poll, args=(s,)) for s in sessions[:4]]
    for p in polls:
        p.start()
    time.sleep(0.5)  # let the polls park (a command sent earlier is taken at once anyway)
    sent = {}
    with cluster_broker.client(ADMIN) as admin:
        for session_id in sessions[:4]:
            reply = admin.post(f"/v1/sessions/{session_id}/commands", json={"command": "break"})
            assert reply.status_code == 202, reply.text
            sent[session_id] = [reply.json()["id"]]
    for p in polls:
        p.join(40)
    assert got == sent

    def follower_saw_everything():
        ids = {e["id"] for e in follower.events}
        done = {e["fields"]["command_id"] for e in follower.events if e["kind"] == "command"}
        return {e["id"] for e in batch} <= ids and {c for v in sent.values() for c in v} <= done

    wait_until(follower_saw_everything, timeout=20)

    # the keys are spread: sessions on more than one node, the global stream on one
    with RedisCluster.from_url(redis_cluster.url, decode_responses=True) as rc:
        owners = {rc.keyslot(keys.session(s)) for s in sessions}
        nodes = {rc.get_node_from_key(keys.session(s)).port for s in sessions}
        assert len(owners) > 1 and len(nodes) > 1
        stored = [json.loads(f["event"])["id"] for _, f in rc.xrange(keys.EVENTS)]
        assert len(stored) == len(set(stored))  # no duplicate left behind by the split ingest
