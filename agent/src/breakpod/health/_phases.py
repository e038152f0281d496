"""Phase timers: ``with breakpod.phase("forward"):`` says where a step's time goes.

Host time comes from ``perf_counter`` (two calls per phase). On CUDA, work is
queued, so the host time of a phase says little: each phase also records two
CUDA events on the current stream (no sync) and reads their elapsed time only
once the end event has completed (``query()``, never ``synchronize()``).
Memory per phase (peak allocated/reserved on CUDA, RSS on CPU) is opt-in:
:func:`track_memory`. ``BREAKPOD_HEALTH=0`` makes every phase a no-op.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from breakpod._core.config import env_flag
from breakpod.health._memory import peak_bytes, reset_peak

MAX_PENDING = 256  # CUDA event pairs waiting to complete; beyond this a phase goes untimed


@dataclasses.dataclass
class PhaseStats:
    count: int = 0
    host_s: float = 0.0
    device_ms: float = 0.0  # CUDA time of the completed phases (0 off CUDA)
    device_count: int = 0
    peak_bytes: int = 0  # with track_memory(): the largest peak seen in this phase


class PhaseTimers:
    """Totals per phase name; ``breakpod.summary(breakpod.health.timers)`` prints them."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseStats] = {}
        self.memory = False
        self._pending: list[tuple[str, Any, Any]] = []

    def add(self, name: str, host_s: float, cuda: tuple[Any, Any] | None, peak: int) -> None:
        stats = self.phases.get(name)
        if stats is None:
            stats = self.phases[name] = PhaseStats()
        stats.count += 1
        stats.host_s += host_s
        stats.peak_bytes = max(stats.peak_bytes, peak)
        if cuda is not None and len(self._pending) < MAX_PENDING:
            self._pending.append((name, *cuda))

    def resolve(self) -> None:
        """Fold in the CUDA timings whose end event completed (non-blocking)."""
        while self._pending and self._pending[0][2].query():
            name, start, end = self._pending.pop(0)
            stats = self.phases[name]
            stats.device_ms += start.elapsed_time(end)
            stats.device_count += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per phase: count, mean host milliseconds, mean CUDA milliseconds, peak MiB."""
        self.resolve()
        return {
            name: {
                "count": s.count,
                "host_ms": 1000 * s.host_s / max(s.count, 1),
                "device_ms": s.device_ms / max(s.device_count, 1),
                "peak_mib": s.peak_bytes / 2**20,
            }
            for name, s in self.phases.items()
        }

    def reset(self) -> None:
        self.phases.clear()
        self._pending.clear()

    def summary_line(self) -> str:
        """Where time goes: each phase's share of the timed total, largest first."""
        snap = self.snapshot()
        total = sum(p["host_ms"] * p["count"] for p in snap.values()) or 1.0
        parts = [
            f"{name} {100 * p['host_ms'] * p['count'] / total:.0f}% ({p['host_ms']:.2f} ms)"
            for name, p in sorted(snap.items(), key=lambda kv: -kv[1]["host_ms"] * kv[1]["count"])
        ]
        return "phases: " + (", ".join(parts) if parts else "none timed")


timers = PhaseTimers()


def health_enabled() -> bool:
    return env_flag("BREAKPOD_HEALTH", True)


_ENABLED = health_enabled()


class phase:
    """Time a block of the training step under ``name`` (host and, on CUDA, device time)."""

    __slots__ = ("_cuda", "_t0", "_timers", "name")

    def __init__(self, name: str, timers_: PhaseTimers | None = None) -> None:
        self.name = name
        self._timers = timers_ or timers
        self._cuda: tuple[Any, Any] | None = None

    def __enter__(self) -> phase:
        if not _ENABLED:
            return self
        self._cuda = _cuda_start()
        if self._timers.memory:
            reset_peak()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if not _ENABLED:
            return
        host = time.perf_counter() - self._t0
        if self._cuda is not None:
            self._cuda[1].record()
        peak = peak_bytes() if self._timers.memory else 0
        self._timers.add(self.name, host, self._cuda, peak)


def track_memory(on: bool = True) -> None:
    """Record each phase's peak memory (CUDA allocated, else RSS); off by default."""
    timers.memory = on


def _cuda_start() -> tuple[Any, Any] | None:
    """Two timing events, the first recorded now, when this process already uses CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    return start, torch.cuda.Event(enable_timing=True)
