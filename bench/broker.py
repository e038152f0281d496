"""Broker benchmark: ingest throughput next to raw XADD, and emit -> SSE latency.

    python bench/broker.py        (or: make bench)

One real redis-server and one real broker process, both on this machine.
Ingest: several agent processes, each running the real emitter (bounded
queue, batched HTTP), emit as fast as they can; compared with pipelined XADD
of the same documents into the same Redis in the same run. Latency: one agent
emits 1,000 events/s, an SSE subscriber measures emit -> receive.
Durability: the same ingest against a Redis with ``appendfsync everysec``, next
to the default ``always`` (an acknowledged event survives a kill of Redis).
Targets: ingest >= 25% of raw XADD; p99 latency < 50 ms.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

AGENTS = int(os.environ.get("BENCH_AGENTS", "4"))
EVENTS_PER_AGENT = 10_000
RAW_EVENTS = 40_000
RATE = 1000
LATENCY_SECONDS = 5
TOKENS = {"agent": "bench-agent-token", "viewer": "bench-viewer-token"}
FIELDS = {
    "module": "encoder.layers.11.mlp",
    "step": 41200,
    "rank": 3,
    "stat": "nan=1 inf=0 max=3.1e38",
}


def main() -> dict[str, float]:
    from breakpod_broker.redis_server import EmbeddedRedis, free_port

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis_server:
        port = free_port()
        broker = _start_broker(redis_server.url, port)
        url = f"http://127.0.0.1:{port}"
        try:
            results = {"raw_xadd_per_s": raw_xadd(redis_server.url)}
            results["ingest_per_s"] = ingest(url)
            results.update(latency(url))
        finally:
            broker.terminate()
            broker.wait(10)
    results["ingest_everysec_per_s"] = ingest_with_fsync("everysec")
    results["ingest_ratio"] = results["ingest_per_s"] / results["raw_xadd_per_s"]
    print(table(results))
    return results


def ingest_with_fsync(fsync: str) -> float:
    """Ingest events/s through a broker whose Redis runs ``appendfsync fsync``."""
    from breakpod_broker.redis_server import EmbeddedRedis, free_port

    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", fsync=fsync) as redis_server,
    ):
        port = free_port()
        broker = _start_broker(redis_server.url, port)
        try:
            return ingest(f"http://127.0.0.1:{port}")
        finally:
            broker.terminate()
            broker.wait(10)


def _start_broker(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    env["BREAKPOD_BROKER_TOKENS"] = ",".join(f"{r}:{t}" for r, t in TOKENS.items())
    cmd = [sys.executable, "-m", "breakpod_broker.cli", "--log-level", "warning", "serve"]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--redis-url", redis_url], env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the broker did not start")


def _document(i: int) -> str:
    doc = {"id": f"raw.{i}", "session": "raw", "kind": "anomaly", "time": time.time()}
    return json.dumps({**doc, "fields": FIELDS})


def raw_xadd(redis_url: str) -> float:
    """Pipelined XADD (MAXLEN ~, like the broker) of the same documents, 500 per round trip."""
    import redis

    client = redis.Redis.from_url(redis_url)
    docs = [_document(i) for i in range(RAW_EVENTS)]
    started = time.perf_counter()
    for first in range(0, RAW_EVENTS, 500):
        pipe = client.pipeline(transaction=False)
        for doc in docs[first : first + 500]:
            pipe.xadd("bench:raw", {"event": doc}, maxlen=100_000, approximate=True)
        pipe.execute()
    elapsed = time.perf_counter() - started
    client.delete("bench:raw")
    return RAW_EVENTS / elapsed


def _agent(url: str, index: int, ready: Any, go: Any, done: Any) -> None:
    from breakpod._link.emitter import Emitter

    emitter = Emitter(
        url,
        TOKENS["agent"],
        session_id=f"bench-{index}",
        info={"job": "bench"},
        queue_size=EVENTS_PER_AGENT,
        poll_commands=False,
    ).start()
    emitter.flush(10)  # registered
    ready.put(index)
    go.wait()
    for _ in range(EVENTS_PER_AGENT):
        emitter.emit("anomaly", FIELDS)
    ok = emitter.flush(60)
    done.put((emitter.sent if ok else -1, emitter.dropped))
    emitter.close()


def ingest(url: str) -> float:
    """Events/s through the emitters' batched HTTP path, AGENTS processes at once."""
    ctx = multiprocessing.get_context("spawn")
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_agent, args=(url, i, ready, go, done)) for i in range(AGENTS)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    started = time.perf_counter()
    go.set()
    outcomes = [done.get(timeout=120) for _ in procs]
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join(10)
    sent = sum(s for s, _ in outcomes)
    if any(s < 0 or d for s, d in outcomes):
        raise RuntimeError(f"agents lost events: {outcomes}")
    return sent / elapsed


def latency(url: str) -> dict[str, float]:
    """Emit at RATE events/s for LATENCY_SECONDS; the SSE subscriber times each arrival."""
    from breakpod._link.client import BrokerClient
    from breakpod._link.emitter import Emitter

    total = RATE * LATENCY_SECONDS
    delays: list[float] = []
    subscriber = BrokerClient(url, TOKENS["viewer"])
    subscribed = threading.Event()

    def listen() -> None:
        stream = subscriber.stream("/v1/events/stream?session=latency&kind=anomaly")
        subscribed.set()
        for _, event in stream:
            delays.append(time.time() - event["fields"]["sent"])
            if len(delays) >= total:
                return

    emitter = Emitter(url, TOKENS["agent"], session_id="latency", info={}, poll_commands=False)
    emitter.start().flush(10)
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    subscribed.wait(10)
    time.sleep(0.5)  # the subscription is open at the broker
    started = time.perf_counter()
    for i in range(total):
        time.sleep(max(0.0, started + i / RATE - time.perf_counter()))
        emitter.emit("anomaly", {"sent": time.time(), "n": i})
    listener.join(30)
    emitter.close()
    if len(delays) < total:
        raise RuntimeError(f"only {len(delays)} of {total} events reached the SSE subscriber")
    cuts = statistics.quantiles(delays, n=100)
    return {"latency_p50_ms": cuts[49] * 1000, "latency_p99_ms": cuts[98] * 1000}


def table(r: dict[str, float]) -> str:
    rows = [
        ("measure", "broker", "reference", "ratio / target"),
        (
            f"ingest, events/s ({AGENTS} agents)",
            f"{r['ingest_per_s']:,.0f}",
            f"{r['raw_xadd_per_s']:,.0f} raw XADD",
            f"{r['ingest_ratio']:.0%} (target >= 25%)",
        ),
        (
            "ingest, appendfsync always (default)",
            f"{r['ingest_per_s']:,.0f}",
            f"{r['ingest_everysec_per_s']:,.0f} everysec",
            f"{r['ingest_per_s'] / r['ingest_everysec_per_s']:.0%} of everysec",
        ),
        (f"emit -> SSE p50 at {RATE}/s", f"{r['latency_p50_ms']:.1f} ms", "", ""),
        (f"emit -> SSE p99 at {RATE}/s", f"{r['latency_p99_ms']:.1f} ms", "", "target < 50 ms"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(["broker benchmark", *lines])


if __name__ == "__main__":
    main()
