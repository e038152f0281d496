"""Broker at scale: many simulated agents over many sockets, against 1 or 3 replicas.

    python bench/scale.py          (short: one small row of each kind; in make bench)
    python bench/scale.py --full   (make scale: 1k / 5k / 10k sessions, 0 / 20 / 100
                                    followers, one and three replicas; long)

One real redis-server (the embedded one, ``appendfsync always`` as the broker's
default) and real broker processes on this machine; the load comes from this
process (asyncio, one keep-alive socket per simulated agent connection, a small
HTTP/1.1 client of its own so that the load generator's cost stays far below the
broker's). Three kinds of row:

* heartbeat: N sessions registered, each heartbeating at the interval the broker
  asks for (15 s, longer with more than 3,000 sessions; open loop, jittered),
  while a viewer reads the first page of ``GET /v1/sessions`` twice a second:
  heartbeat p50/p99, first page p99.
* ingest: 200 agents posting small batches at a steady rate while F followers
  read ``/v1/events/stream`` (spread over the replicas): POST p50/p99 and
  emit -> SSE p99 (over every follower); then the same agents as fast as they can,
  next to raw pipelined XADD of the same documents (bench/broker.py's reference).
* break: N sessions long-poll for commands, an admin sends ``break`` to every one:
  per-session send -> delivered p50/p99, and the time until the last one has it.
* jobbreak: the same N waiting polls, and one job-wide ``break`` (one request,
  ``POST /v1/jobs/{job}/commands``): send -> delivered p50/p99 per session.

Broker CPU is the broker processes' CPU time over the measured window (100% = one
core); Redis's and the load generator's are shown next to it. Targets are the
issue's; this 2-core machine is shared, so read each row with its CPU columns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOKENS = {"agent": "scale-agent-token", "viewer": "scale-viewer-token", "admin": "scale-admin-tok"}
HEARTBEAT_SECONDS = 15.0  # the agent's (breakpod._link.emitter.HEARTBEAT_SECONDS)
POLL_SECONDS = 120.0  # a break row's long polls (BREAKPOD_MAX_POLL_SECONDS raised to match)
REQUEST_TIMEOUT = POLL_SECONDS + 60
PARKED_PER_SECOND = 250  # polls assumed parked per second before the send
FIELDS = {"module": "encoder.layers.11.mlp", "step": 41200, "rank": 3, "stat": "nan=1 max=3e38"}
TARGETS = {
    "heartbeat_p99": "<= 100 ms (10k sessions, 3 replicas)",
    "page_p99": "<= 50 ms",
    "post_p99": "<= 100 ms (200 agents, 100 followers)",
    "sse_p99": "<= 250 ms",
    "break_p99": "<= 1000 ms (10k sessions)",
    "ingest_ratio": ">= 40% of raw XADD",
}


# -- a small keep-alive HTTP/1.1 client ---------------------------------------------


class Conn:
    """One keep-alive socket to a broker; one request at a time."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.auth = f"Authorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: broker\r\n{self.auth}"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.writer.write(head.encode() + data)
        try:
            return await asyncio.wait_for(_response(self.reader), REQUEST_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


class Pool:
    """``size`` connections to the replicas (round robin); ``request`` takes a free one."""

    def __init__(self, ports: list[int], token: str, size: int) -> None:
        self.free: asyncio.Queue[Conn] = asyncio.Queue()
        for i in range(size):
            self.free.put_nowait(Conn(ports[i % len(ports)], token))
        self.conns = size

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        conn = await self.free.get()
        try:
            return await conn.request(method, path, body)
        finally:
            self.free.put_nowait(conn)

    def close(self) -> None:
        while not self.free.empty():
            self.free.get_nowait().close()


async def timed(pool: Pool, method: str, path: str, body: Any = None) -> float:
    """Seconds for one request; raises on a status other than 2xx."""
    started = time.perf_counter()
    status, reply = await pool.request(method, path, body)
    if not 200 <= status < 300:
        raise RuntimeError(f"{method} {path}: {status} {reply[:200]!r}")
    return time.perf_counter() - started


# -- processes: Redis, brokers, CPU ---------------------------------------------------


@dataclasses.dataclass
class Cluster:
    """One embedded redis-server and ``replicas`` broker processes on it."""

    redis: Any
    brokers: list[subprocess.Popen[bytes]]
    ports: list[int]

    def cpu(self) -> CpuMeter:
        import psutil

        return CpuMeter(
            [psutil.Process(p.pid) for p in self.brokers],
            psutil.Process(self.redis.proc.pid),
        )


@contextlib.contextmanager
def running(replicas: int, fsync: str = "always", **env: str) -> Iterator[Cluster]:
    from breakpod_broker.redis_server import EmbeddedRedis, free_port

    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "redis", fsync=fsync) as redis,
    ):
        ports = [free_port() for _ in range(replicas)]
        brokers = [_start_broker(redis.url, port, env) for port in ports]
        try:
            for port in ports:
                _wait_ready(port)
            yield Cluster(redis, brokers, ports)
        finally:
            for proc in brokers:
                proc.terminate()
            for proc in brokers:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def _start_broker(redis_url: str, port: int, extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    env["BREAKPOD_BROKER_TOKENS"] = ",".join(f"{r}:{t}" for r, t in TOKENS.items())
    env.update(extra)
    cmd = [sys.executable, "-m", "breakpod_broker.cli", "--log-level", "warning", "serve"]
    cmd += ["--port", str(port), "--redis-url", redis_url]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def _wait_ready(port: int, timeout: float = 60.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the broker on port {port} did not start within {timeout:.0f} s")


class CpuMeter:
    """CPU seconds of the brokers, Redis and this process over a window, as % of a core."""

    def __init__(self, brokers: list[Any], redis: Any) -> None:
        import psutil

        self.procs = {"broker": brokers, "redis": [redis], "load": [psutil.Process()]}
        self.start = self._times()
        self.started = time.monotonic()

    def _times(self) -> dict[str, float]:
        return {
            name: sum(sum(p.cpu_times()[:2]) for p in procs) for name, procs in self.procs.items()
        }

    def percent(self) -> dict[str, float]:
        """% of one core per process group, and ``broker_seconds``: the brokers' CPU time."""
        wall = time.monotonic() - self.started
        now = self._times()
        used = {name: 100 * (now[name] - self.start[name]) / wall for name in now}
        return {**used, "broker_seconds": now["broker"] - self.start["broker"]}


# -- the rows --------------------------------------------------------------------------


def quantiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    if len(samples) < 2:
        value = samples[0] * 1000 if samples else float("nan")
        return value, value
    cuts = statistics.quantiles(samples, n=100)
    return cuts[49] * 1000, cuts[98] * 1000


async def register_all(pool: Pool, sessions: list[str], job: str) -> None:
    async def one(session_id: str) -> None:
        await timed(pool, "PUT", f"/v1/sessions/{session_id}", {"job": job, "rank": 0})

    await gather_bounded([one(s) for s in sessions], pool.conns)


async def gather_bounded(work: list[Any], limit: int) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def run(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(run(w) for w in work))


async def asked_interval(pool: Pool, session_id: str) -> float:
    """The heartbeat interval the broker asks agents for (``heartbeat_seconds``), once it
    has counted the sessions just registered (in the background, every few seconds)."""
    await asyncio.sleep(6.0)
    status, body = await pool.request("POST", f"/v1/sessions/{session_id}/heartbeat", {})
    asked = json.loads(body).get("heartbeat_seconds") if status == 200 else None
    return float(asked or HEARTBEAT_SECONDS)


async def heartbeat_row(cluster: Cluster, sessions: int, seconds: float) -> dict[str, Any]:
    """Open loop: each session beats every HEARTBEAT_SECONDS (jittered start), during
    ``seconds``; a viewer reads the first page twice a second meanwhile."""
    ids = [f"hb-{i:05d}" for i in range(sessions)]
    agents = Pool(cluster.ports, TOKENS["agent"], min(sessions, 500))
    await register_all(agents, ids, "scale")
    # the rate the sessions make at the interval the broker asks for (it grows with
    # the session count: liveness.py); a short run covers a slice
    agents.close()  # idle past the brokers' keep-alive while they count: new sockets
    interval = await asked_interval(Pool(cluster.ports, TOKENS["agent"], 1), ids[0])
    agents = Pool(cluster.ports, TOKENS["agent"], min(sessions, 500))
    viewer = Pool(cluster.ports, TOKENS["viewer"], len(cluster.ports))
    for _ in cluster.ports:  # a replica's first page of a scope may count it: not timed
        await timed(viewer, "GET", "/v1/sessions?limit=100")
    beats: list[float] = []
    pages: list[float] = []
    errors = 0
    rate = sessions / interval
    total = int(rate * seconds)
    meter = cluster.cpu()
    started = time.perf_counter()

    async def beat(i: int) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        try:
            beats.append(
                await timed(agents, "POST", f"/v1/sessions/{ids[i % sessions]}/heartbeat", {})
            )
        except Exception:
            errors += 1

    async def read_pages() -> None:
        while time.perf_counter() - started < seconds:
            pages.append(await timed(viewer, "GET", "/v1/sessions?limit=100"))
            await asyncio.sleep(0.5)

    await asyncio.gather(*(beat(i) for i in range(total)), read_pages())
    cpu = meter.percent()
    agents.close()
    viewer.close()
    p50, p99 = quantiles(beats)
    return {
        "row": f"heartbeat {sessions:,} sessions, {len(cluster.ports)} replica(s)",
        "measured": f"beat p50 {p50:.0f} ms p99 {p99:.0f} ms (every {interval:g} s: "
        f"{rate:.0f}/s, {errors} errors); "
        f"page p99 {quantiles(pages)[1]:.0f} ms",
        "target": f"{TARGETS['heartbeat_p99']}; page {TARGETS['page_p99']}",
        "cpu": cpu,
        "per_op": ("request", cpu["broker_seconds"] / max(1, len(beats) + len(pages))),
    }


class Follower:
    """One SSE stream; records emit -> arrival for each event that carries ``sent``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.delays: list[float] = []
        self.ready = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = "GET /v1/events/stream?kind=anomaly HTTP/1.1\r\nHost: broker\r\n"
        head += f"Authorization: Bearer {TOKENS['viewer']}\r\n\r\n"
        writer.write(head.encode())
        try:
            while line := await reader.readline():
                if line.startswith(b"retry:"):
                    self.ready.set()
                if line.startswith(b"data: "):
                    sent = json.loads(line[6:])["fields"].get("sent")
                    if sent is not None:
                        self.delays.append(time.time() - sent)
        finally:
            writer.close()


async def ingest_row(
    cluster: Cluster, agents: int, followers: int, seconds: float, rate: float
) -> dict[str, Any]:
    """``agents`` each post one event every 1/``rate`` s while ``followers`` stream."""
    ids = [f"in-{i:04d}" for i in range(agents)]
    pool = Pool(cluster.ports, TOKENS["agent"], agents)
    await register_all(pool, ids, "ingest")
    streams = [Follower(cluster.ports[i % len(cluster.ports)]) for i in range(followers)]
    for f in streams:
        f.task = asyncio.create_task(f.run())
    await asyncio.wait_for(asyncio.gather(*(f.ready.wait() for f in streams)), 60)
    posts: list[float] = []
    errors = 0
    meter = cluster.cpu()
    started = time.perf_counter()

    async def agent(index: int) -> None:
        nonlocal errors
        n = 0
        offset = random.random() / rate
        while (due := started + offset + n / rate) < started + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            event = {
                "id": f"{ids[index]}-{n}",
                "session": ids[index],
                "kind": "anomaly",
                "fields": {**FIELDS, "sent": time.time()},
            }
            try:
                posts.append(await timed(pool, "POST", "/v1/events", {"events": [event]}))
            except Exception:
                errors += 1
            n += 1

    await asyncio.gather(*(agent(i) for i in range(agents)))
    await asyncio.sleep(1.0)  # the last events reach the followers
    cpu = meter.percent()
    for f in streams:
        assert f.task is not None
        f.task.cancel()
    delays = [d for f in streams for d in f.delays]
    throughput = await ingest_throughput(pool, ids)
    pool.close()
    p50, p99 = quantiles(posts)
    sse = f"; emit->SSE p99 {quantiles(delays)[1]:.0f} ms ({len(delays):,} arrivals)"
    return {
        "row": f"ingest {agents} agents x {rate:g}/s, {followers} followers, "
        f"{len(cluster.ports)} replica(s)",
        "measured": f"POST p50 {p50:.0f} ms p99 {p99:.0f} ms ({errors} errors)"
        + (sse if followers else "")
        + f"; flat out {throughput:,.0f} events/s",
        "target": TARGETS["post_p99"] + ("; SSE " + TARGETS["sse_p99"] if followers else ""),
        "cpu": cpu,
        "throughput": throughput,
        "per_op": ("POST", cpu["broker_seconds"] / max(1, len(posts))),
    }


async def ingest_throughput(pool: Pool, ids: list[str], batch: int = 50) -> float:
    """Events/s with every agent posting batches of ``batch`` back to back, for ~2 s."""
    sent = 0
    started = time.perf_counter()

    async def agent(session_id: str) -> None:
        nonlocal sent
        n = 0
        while time.perf_counter() - started < 2.0:
            events = [
                {"id": f"{session_id}-t{n}-{k}", "session": session_id, "kind": "anomaly"}
                | {"fields": FIELDS}
                for k in range(batch)
            ]
            await timed(pool, "POST", "/v1/events", {"events": events})
            sent += batch
            n += 1

    await asyncio.gather(*(agent(s) for s in ids))
    return sent / (time.perf_counter() - started)


async def break_row(cluster: Cluster, sessions: int, job_wide: bool = False) -> dict[str, Any]:
    """Every session long-polls on its own socket; an admin sends each a ``break``
    (``job_wide``: one ``break`` to their job, one request)."""
    ids = [f"br-{i:05d}" for i in range(sessions)]
    setup = Pool(cluster.ports, TOKENS["agent"], min(sessions, 200))
    await register_all(setup, ids, "break")
    setup.close()
    received: dict[str, float] = {}
    refused = {"polls": 0, "sends": 0}
    refused_at: list[float] = []  # when polls were refused: before the send (arrival) or after
    polls = [Conn(cluster.ports[i % len(cluster.ports)], TOKENS["agent"]) for i in range(len(ids))]

    async def poll(session_id: str, conn: Conn) -> None:
        while session_id not in received:
            status, body = await conn.request(
                "GET", f"/v1/sessions/{session_id}/commands?wait={POLL_SECONDS:g}"
            )
            if status == 200 and json.loads(body)["commands"]:
                received[session_id] = time.perf_counter()
            elif status != 200:  # 503/429 under the burst: poll again, as the agent does
                refused["polls"] += 1
                refused_at.append(time.perf_counter())
                await asyncio.sleep(1.0)
        conn.close()

    waiting = [asyncio.create_task(poll(s, c)) for s, c in zip(ids, polls, strict=True)]
    # every poll parked (no arrival still in work) before the send: a poll waits
    # POLL_SECONDS, longer than the arrival of 10,000 takes on two shared cores
    await asyncio.sleep(2.0 + sessions / PARKED_PER_SECOND)
    admin = Pool(cluster.ports, TOKENS["admin"], 1 if job_wide else min(sessions, 200))
    sent_at: dict[str, float] = {}
    meter = cluster.cpu()
    first = time.perf_counter()

    async def send(session_id: str) -> None:
        sent_at[session_id] = time.perf_counter()
        path = f"/v1/sessions/{session_id}/commands"
        while (await admin.request("POST", path, {"command": "break"}))[0] != 202:
            refused["sends"] += 1  # counted and sent again, as a client would

    if job_wide:
        sent_at = dict.fromkeys(ids, first)
        while (await admin.request("POST", "/v1/jobs/break/commands", {"command": "break"}))[
            0
        ] != 202:
            refused["sends"] += 1
    else:
        await gather_bounded([send(s) for s in ids], admin.conns)
    sending = time.perf_counter() - first
    await asyncio.wait_for(asyncio.gather(*waiting), 120)
    cpu = meter.percent()
    admin.close()
    delays = [received[s] - sent_at[s] for s in ids]
    p50, p99 = quantiles(delays)
    last = max(received.values()) - first
    how = "job-wide break (one request)" if job_wide else "break to each session"
    return {
        "row": f"{how}, {sessions:,} sessions, {len(cluster.ports)} replica(s)",
        "measured": f"send->delivered p50 {p50:.0f} ms p99 {p99:.0f} ms; sending took "
        f"{sending:.1f} s, the last had it after {last:.1f} s; refused and retried: "
        f"{refused['sends']} sends, {refused['polls']} polls "
        f"({sum(t > first for t in refused_at)} after the send)",
        "target": TARGETS["break_p99"],
        "cpu": cpu,
        "per_op": ("session reached", cpu["broker_seconds"] / sessions),
    }


# -- the grid and the table -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str
    replicas: int
    sessions: int = 0
    followers: int = 0


SHORT = [
    Row("heartbeat", 1, sessions=1000),
    Row("ingest", 1, sessions=200, followers=20),
    Row("break", 1, sessions=1000),
    Row("jobbreak", 1, sessions=1000),
]
FULL = [
    *(Row("heartbeat", r, sessions=n) for r in (1, 3) for n in (1000, 5000, 10_000)),
    *(Row("ingest", r, sessions=200, followers=f) for r in (1, 3) for f in (0, 20, 100)),
    *(Row("break", r, sessions=n) for r in (1, 3) for n in (1000, 5000, 10_000)),
    *(Row("jobbreak", r, sessions=n) for r in (1, 3) for n in (1000, 5000, 10_000)),
]


def run_loop(work: Any, loop: str) -> Any:
    """``work`` on the load generator's event loop: uvloop (the brokers' own; it costs the
    simulated agents about half the CPU of asyncio's loop, which shares the same two
    cores with the brokers) or asyncio's (the rounds before this option)."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(work)
    return asyncio.run(work)


def measure(
    row: Row, full: bool, broker_env: dict[str, str] | None = None, loop: str = "uvloop"
) -> dict[str, Any]:
    env = {"BREAKPOD_MAX_POLL_SECONDS": f"{POLL_SECONDS:g}"} if "break" in row.kind else {}
    env.update(broker_env or {})
    with running(row.replicas, **env) as cluster:
        if row.kind == "heartbeat":
            work = heartbeat_row(cluster, row.sessions, 20.0 if full else 4.0)
        elif row.kind == "ingest":
            work = ingest_row(cluster, row.sessions, row.followers, 10.0 if full else 3.0, 2.0)
        else:
            work = break_row(cluster, row.sessions, job_wide=row.kind == "jobbreak")
        result = run_loop(work, loop)
        if row.kind == "ingest":
            result["raw_xadd"] = raw_xadd(cluster.redis.url)
            ratio = result["throughput"] / result["raw_xadd"]
            result["measured"] += f" = {ratio:.0%} of raw XADD {result['raw_xadd']:,.0f}/s"
            result["target"] += f"; {TARGETS['ingest_ratio']}"
        return result


def raw_xadd(redis_url: str) -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    import broker as broker_bench  # bench/broker.py: the same reference

    return float(broker_bench.raw_xadd(redis_url))


def table(results: list[dict[str, Any]]) -> str:
    lines = ["broker at scale (CPU: % of one core over the measured window)"]
    for r in results:
        cpu = r["cpu"]
        lines.append(f"* {r['row']}")
        lines.append(f"    measured: {r['measured']}")
        lines.append(f"    target:   {r['target']}")
        lines.append(
            f"    CPU:      broker {cpu['broker']:.0f}%, redis {cpu['redis']:.0f}%, "
            f"load generator {cpu['load']:.0f}%; broker CPU per {r['per_op'][0]}: "
            f"{r['per_op'][1] * 1000:.2f} ms"
        )
    load = os.getloadavg()
    lines.append(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} at the end")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (make scale)")
    parser.add_argument(
        "--kind", choices=["heartbeat", "ingest", "break", "jobbreak"], action="append"
    )
    parser.add_argument("--sessions", type=int, help="only the rows of this many sessions")
    parser.add_argument("--replicas", type=int, help="only the rows of this many replicas")
    parser.add_argument(
        "--broker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the brokers (BREAKPOD_HEARTBEAT_RATE=1e6: the 15 s beat at any size)",
    )
    parser.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="the load generator's event loop (asyncio: as measured before this option)",
    )
    args = parser.parse_args([] if argv is None else argv)
    broker_env = dict(pair.split("=", 1) for pair in args.broker_env)
    rows = [r for r in (FULL if args.full else SHORT) if not args.kind or r.kind in args.kind]
    rows = [r for r in rows if args.sessions in (None, r.sessions)]
    rows = [r for r in rows if args.replicas in (None, r.replicas)]
    results = []
    for row in rows:
        results.append(measure(row, args.full, broker_env, args.loop))
        print(f"  done: {results[-1]['row']}", flush=True)
    print(table(results), flush=True)
    print(f"load generator's event loop: {args.loop}", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
