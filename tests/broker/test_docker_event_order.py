"""The docker watch's reading of the engine's events in the orders a loaded engine
sends them: an ``oom`` after its container's ``die`` (the engine reads the cgroup's
oom apart from the process's exit) still makes the death OOMKilled, and one death
waiting for its oom holds no other. The events are the engine's own JSON; no
engine is needed (the real engine's run is tests/broker/test_docker_watch.py,
under make e2e-docker). The sessions live in a broker with a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from breakpod_broker import app as broker_app
from breakpod_broker.docker_watch import OOM_GRACE, DockerWatch
from breakpod_broker.settings import BrokerSettings
from tests.brokerkit import VIEWER, register

NANO = 1_796_524_409_258_995_695


def event(action: str, container: str, exit_code: int | None = None) -> dict[str, Any]:
    """An engine event as the SDK decodes it (``docker events --format json``)."""
    attributes = {"name": container} | ({"exitCode": str(exit_code)} if exit_code else {})
    return {
        "status": action,
        "id": container * 4,
        "Type": "container",
        "Action": action,
        "Actor": {"ID": container * 4, "Attributes": attributes},
        "time": NANO // 10**9,
        "timeNano": NANO,
    }


def watch_events(broker: Any, timed: list[tuple[float, dict[str, Any]]]) -> list[str]:
    """Feed ``(delay, event)`` pairs to a running watch; the order the deaths were recorded."""

    async def run() -> list[str]:
        settings = BrokerSettings(redis_url=broker.redis_url, broker_tokens="", docker_watch="off")
        async with broker_app._running(settings) as running:
            watch = DockerWatch(running)  # no engine: its events come from the test
            order: list[str] = []
            record = watch.handle

            async def handle(e: dict[str, Any]) -> None:
                await record(e)
                order.append(e["Action"] + ":" + e["id"][:12])

            watch.handle = handle  # type: ignore[method-assign]
            watch.task = asyncio.create_task(watch._handle_all())
            for delay, e in timed:
                await asyncio.sleep(delay)
                watch.queue.put_nowait(e)
            while len(order) < len(timed):
                await asyncio.sleep(0.05)
            await watch.close()
            return order

    return asyncio.run(run())


def ended(broker: Any) -> dict[str, tuple[str, str]]:
    with broker.client(VIEWER) as c:
        found = c.get("/v1/sessions").json()["sessions"]
    return {s["id"]: (s["state"], s.get("reason", "")) for s in found}


@pytest.mark.timeout(60)
def test_an_oom_that_comes_after_its_die_still_reads_oomkilled(broker):
    oomed, killed, failed = "a1" * 6, "b2" * 6, "c3" * 6
    for sid, container in (("oomed", oomed), ("killed", killed), ("failed", failed)):
        register(broker, sid, runtime="docker", container=container, host=container)
    order = watch_events(
        broker,
        [
            (0, event("die", oomed, 137)),  # the OOM killer's SIGKILL, read before its oom
            (0, event("die", killed, 137)),  # docker kill: no oom ever comes
            (0, event("die", failed, 3)),
            (OOM_GRACE / 3, event("oom", oomed)),
        ],
    )
    assert ended(broker) == {
        "oomed": ("killed", "OOMKilled (exit 137)"),
        "killed": ("killed", "signal 9 (SIGKILL) (exit 137)"),
        "failed": ("failed", "exit 3"),
    }
    # the failed exit was recorded at once, while both SIGKILLs waited for their oom
    assert order[:3] == [f"die:{failed}", f"oom:{oomed}", f"die:{oomed}"]
    assert order[3] == f"die:{killed}"


@pytest.mark.timeout(60)
def test_an_oom_before_its_die_is_read_at_once(broker):
    container = "d4" * 6
    register(broker, "oomed", runtime="docker", container=container)
    order = watch_events(broker, [(0, event("oom", container)), (0, event("die", container, 137))])
    assert order == [f"oom:{container}", f"die:{container}"]
    assert ended(broker)["oomed"] == ("killed", "OOMKilled (exit 137)")
