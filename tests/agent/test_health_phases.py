"""Phase timers and memory: where time and memory go, and a leak caught as it grows."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

import breakpod
from breakpod.health import MemoryGrowth, memory
from breakpod.health._phases import PhaseTimers, phase


def test_phases_say_where_the_time_goes() -> None:
    timers = PhaseTimers()
    for _ in range(3):
        with phase("data", timers):
            time.sleep(0.002)
        with phase("forward", timers):
            time.sleep(0.02)
    snap = timers.snapshot()
    assert snap["data"]["count"] == snap["forward"]["count"] == 3
    assert snap["forward"]["host_ms"] > snap["data"]["host_ms"] >= 2.0
    line = breakpod.summary(timers)
    assert line.startswith("phases: forward ") and line.index("forward") < line.index("data")


def test_a_phase_that_raises_is_still_timed() -> None:
    timers = PhaseTimers()
    with pytest.raises(ValueError), phase("optimizer", timers):
        raise ValueError("boom")
    assert timers.snapshot()["optimizer"]["count"] == 1


def test_health_off_means_phases_record_nothing() -> None:
    code = (
        "import breakpod\nwith breakpod.phase('data'): pass\nprint(breakpod.health.timers.phases)"
    )
    env = {"BREAKPOD_HEALTH": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.strip() == "{}", out.stderr


def test_tracked_memory_records_a_peak_per_phase() -> None:
    timers = PhaseTimers()
    timers.memory = True
    with phase("forward", timers):
        block = torch.ones(8 * 2**20, dtype=torch.uint8)  # 8 MiB, touched
    del block
    assert timers.snapshot()["forward"]["peak_mib"] > 8
    assert memory()["rss"] > 0


def test_memory_growth_fires_on_a_leak_and_not_on_a_steady_loop() -> None:
    leak, steady = MemoryGrowth(steps=5, limit_mb=4), MemoryGrowth(steps=5, limit_mb=4)
    kept = []
    for step in range(12):
        kept.append(torch.ones(2**20, dtype=torch.uint8))  # 1 MiB kept per step: a leak
        leak.sample(step, used=sum(t.numel() for t in kept))
        steady.sample(step, used=2**20)
    assert steady.fired == []
    assert leak.fired and leak.fired[0]["check"] == "memory_growth"
    assert leak.fired[0]["step"] == 5  # 5 MiB over 5 steps > 4
    assert len(leak.fired) == 2  # once per further 4 MiB, not at every step


def test_memory_growth_hears_the_monitor_reads() -> None:
    model = torch.nn.Linear(4, 4)
    check = breakpod.health.memory_growth(steps=1, limit_mb=32)
    kept = []
    try:
        with breakpod.watch(model) as monitor:
            for _ in range(4):
                kept.append(torch.ones(64 * 2**20, dtype=torch.uint8))  # RSS grows 64 MiB
                model(torch.randn(2, 4)).sum().backward()
                monitor.step()
    finally:
        check.close()
    assert check.fired, "RSS grew 64 MiB per step and the rule stayed quiet"


def test_rss_in_a_forked_worker_is_the_worker_s_own() -> None:
    """The parent's open /proc/self/statm would keep reading the parent after a fork."""
    from breakpod.health._memory import rss_bytes

    rss_bytes()  # opens /proc/self/statm in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader-style worker that grows by 128 MiB (no torch after a fork)
        try:
            before = rss_bytes()
            block = b"\x01" * (128 * 2**20)  # written, so resident
            os.write(write, f"{before} {rss_bytes()}".encode())
            del block
        finally:
            os._exit(0)
    os.close(write)
    before, after = map(int, os.read(read, 64).split())
    os.waitpid(pid, 0)
    assert after - before > 100 * 2**20, (before, after)


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": "100"}, {"steps": 0}, {"steps": 2.5}, {"limit_mb": math.nan}, {"limit_mb": -1}],
)
def test_memory_growth_refuses_what_it_could_never_judge(kwargs) -> None:
    """``steps="100"`` failed at the first read with a traceback and the check was off;
    ``limit_mb=nan`` never fired."""
    with pytest.raises(breakpod.ConfigError, match="memory_growth"):
        breakpod.health.memory_growth(**kwargs)
