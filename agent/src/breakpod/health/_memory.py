"""Memory: what the process holds now, and a leak check (``check: memory_growth``).

Off CUDA the number is the resident set size (``/proc/self/statm``, one small
read). On CUDA it is the caching allocator's own counters (host-side, no
sync): allocated and reserved, with their peaks.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import resource
import sys
from typing import Any

from breakpod import protocol
from breakpod._core import events
from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# pid -> an open /proc/self/statm, read again with pread (no open per call); by pid,
# since after a fork (a DataLoader worker) the inherited one still reads the parent.
_statm: dict[int, int] = {}


def rss_bytes() -> int:
    """The process's resident set size now (its peak where /proc is missing)."""
    try:
        pid = os.getpid()
        fd = _statm.get(pid)
        if fd is None:
            fd = _statm[pid] = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(fd, 128, 0).split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cuda() -> Any:
    """torch.cuda when this process already uses it (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def memory() -> dict[str, int]:
    """``{"rss": …}`` plus, on CUDA, allocated/reserved now and at their peaks (bytes)."""
    out = {"rss": rss_bytes()}
    cuda = _cuda()
    if cuda is not None:
        out["allocated"] = cuda.memory_allocated()
        out["reserved"] = cuda.memory_reserved()
        out["peak_allocated"] = cuda.max_memory_allocated()
        out["peak_reserved"] = cuda.max_memory_reserved()
    return out


def in_use() -> int:
    """The number a leak shows in: CUDA allocated bytes, else RSS."""
    cuda = _cuda()
    return int(cuda.memory_allocated()) if cuda is not None else rss_bytes()


def peak_bytes() -> int:
    cuda = _cuda()
    return int(cuda.max_memory_allocated()) if cuda is not None else rss_bytes()


def reset_peak() -> None:
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()


@dataclasses.dataclass
class MemoryGrowth:
    """``check: memory_growth``: memory in use grew by more than ``limit_mb`` over
    ``steps`` steps. Fires once per ``limit_mb`` of further growth, as an
    ``anomaly`` event (exporters and the broker see it) and a line on stderr."""

    steps: int = 100
    limit_mb: float = 256.0
    fired: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._window: collections.deque[tuple[int, int]] = collections.deque()
        self._floor: int | None = None  # after a report: growth counts from here

    def sample(self, step: int, used: int | None = None) -> dict[str, Any] | None:
        """Record memory at ``step``; the anomaly's fields when the rule fires."""
        used = in_use() if used is None else used
        self._window.append((step, used))
        while self._window and self._window[0][0] < step - self.steps:
            self._window.popleft()
        first_step, first = self._window[0]
        base = max(first, self._floor or 0)
        grown = (used - base) / 2**20
        if step - first_step < self.steps or grown <= self.limit_mb:
            return None
        self._floor = used
        return self._report(step, first_step, grown, used)

    def _report(self, step: int, since: int, grown: float, used: int) -> dict[str, Any]:
        summary = (
            f"memory in use grew {grown:.0f} MiB over steps {since}..{step} "
            f"(now {used / 2**20:.0f} MiB): tensors kept across steps? (e.g. a loss list "
            "without .item()/.detach())"
        )
        fields = {
            "rule": "memory_growth",
            "check": "memory_growth",
            "module": "",
            "step": step,
            "phase": "memory",
            "summary": summary,
            "value": grown,
        }
        self.fired.append(fields)
        announce(f"step {step}: [memory_growth] {summary}")
        events.emit(protocol.ANOMALY, **fields)
        return fields

    def _on_stats(self, event: events.Event) -> None:
        if event.kind == events.STEP_STATS and event.fields["read_done"]:
            self.sample(event.fields["steps"][-1].step)

    def close(self) -> None:
        events.remove_local_sink(self._on_stats)


def memory_growth(steps: int = 100, limit_mb: float = 256.0) -> MemoryGrowth:
    """Watch for growth at every monitor read (call ``.sample(step)`` yourself without one).
    Raises :class:`ConfigError` for a ``steps`` that is not a positive whole number or
    a ``limit_mb`` that is not a positive finite number."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"memory_growth(steps={steps!r}): expected a whole number of steps, >= 1")
    if isinstance(limit_mb, bool) or not isinstance(limit_mb, int | float):
        raise ConfigError(f"memory_growth(limit_mb={limit_mb!r}): expected a number of MiB")
    if not (math.isfinite(limit_mb) and limit_mb > 0):
        raise ConfigError(f"memory_growth(limit_mb={limit_mb!r}): expected a positive, finite MiB")
    check = MemoryGrowth(steps=steps, limit_mb=limit_mb)
    events.add_local_sink(check._on_stats)
    return check
