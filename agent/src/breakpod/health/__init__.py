"""The training health toolkit: cheap checks around the training loop.

    with breakpod.phase("forward"): ...          # timers (CUDA events, no syncs)
    breakpod.summary(breakpod.health.timers)     # where a step's time goes
    breakpod.health.track_memory()               # peak memory per phase
    leak = breakpod.health.memory_growth(steps=200, limit_mb=512)   # check: memory_growth
    breakpod.health.placement(model)             # names the module whose inputs are misplaced
    print(breakpod.health.overlap(train_set, val_set))              # data leakage
    breakpod.break_if((loss > 10) | ~loss.isfinite(), every=50)     # park when it holds

Nothing here runs unless called; ``BREAKPOD_HEALTH=0`` turns the timers off.
"""

from __future__ import annotations

from breakpod.health._break_if import break_if
from breakpod.health._memory import MemoryGrowth, memory, memory_growth
from breakpod.health._overlap import Overlap, overlap
from breakpod.health._phases import phase, timers, track_memory
from breakpod.health._placement import Placement, PlacementError, placement

__all__ = [
    "MemoryGrowth",
    "Overlap",
    "Placement",
    "PlacementError",
    "break_if",
    "memory",
    "memory_growth",
    "overlap",
    "phase",
    "placement",
    "timers",
    "track_memory",
]
