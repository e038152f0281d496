"""Step boundaries from torch's global optimizer hooks, for loops that never call
``breakpod.step()`` (debug mode with no code: a framework's loop, or a plain one).

* A step is one ``step()`` of the *lead* optimizer, the first one that stepped.
  Another optimizer (a GAN's second) keeps the job alive and does not count, so a
  job's step numbers are its iterations, on every rank alike.
* The boundary is the lead optimizer's post-hook, after the update: the stall
  clock beats there, and a job-wide break or ``breakpod send ... break`` parks
  there, in the innermost frame outside torch and breakpod (``up`` walks out
  through the framework's frames to the user's).
* Where steps are marked otherwise, that wins: ``breakpod.step()``, or a monitor
  ending its step before the update. The first step is counted but is no boundary
  (a loop's own ``breakpod.step()`` shows by the second); a post-hook that finds a
  boundary it did not make since its own last one stands aside (and looks again at
  the next step).
* Gradient accumulation is one optimizer step for several forwards: one boundary.
  A step the optimizer never takes (GradScaler found an inf) calls no hook, so it
  is no step; the model's forwards (:func:`alive`) keep the stall clock from
  counting it, as they do an evaluation.

Installed only in debug mode (``_integrations/autostart``); off, nothing is registered.
"""

from __future__ import annotations

import sys
import time
import weakref
from types import FrameType
from typing import Any

from breakpod._core.announce import announce
from breakpod._job import boundary

_handles: list[Any] = []
_lead: weakref.ref[Any] | None = None  # the optimizer whose steps count
_count = 0  # the lead optimizer's steps
_mine: float | None = None  # the watchdog's last beat, as this module's boundary left it
_failed = False


def install() -> None:
    """Register the global post-hook (torch is imported)."""
    if _handles:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _handles.append(register_optimizer_step_post_hook(_after_step))


def remove() -> None:
    global _lead, _count, _mine
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _lead, _count, _mine = None, 0, None


def installed() -> bool:
    return bool(_handles)


def alive() -> None:
    """The model ran a forward (training, accumulating or evaluating): not silent."""
    active = boundary.active()
    if active is not None:
        active.alive_at = time.monotonic()


def others_mark_steps() -> bool:
    """Was a step boundary made since this module's last one that it did not make
    (``breakpod.step()``, a monitor's)? Always when this module makes none."""
    active = boundary.active()
    if active is None or active.step is None:
        return False
    return not _handles or active.last_beat != _mine


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _failed
    try:
        _boundary(optimizer, sys._getframe(1))
    except Exception as e:  # a boundary must never take the training step down
        if not _failed:
            _failed = True
            announce(f"optimizer step boundary failed ({type(e).__name__}: {e}); training goes on")


def _boundary(optimizer: Any, frame: FrameType) -> None:
    global _lead, _count, _mine
    lead = _lead() if _lead is not None else None
    if lead is None:  # the first step: counted, and a boundary from the next one on (a
        _lead, _count = weakref.ref(optimizer), 1  # loop's breakpod.step() shows by then)
        active = boundary.active()
        _mine = active.last_beat if active is not None else None
        return
    if lead is not optimizer:
        alive()
        return
    active = boundary.active()
    if active is not None and active.step is not None and active.last_beat != _mine:
        _mine = active.last_beat  # the loop or a monitor marked a step since ours
        return
    _count += 1
    frame = outside_libraries(frame)
    boundary.boundary(_count, frame)  # `breakpod send ID break` parks here too
    active = boundary.active()
    _mine = active.last_beat if active is not None else None


def outside_libraries(frame: FrameType) -> FrameType:
    """The innermost frame outside torch and breakpod (the monitor's rule for a park)."""
    found: FrameType | None = frame
    while found is not None and _ours_or_torch(found):
        found = found.f_back
    return found if found is not None else frame


def _ours_or_torch(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in ("torch", "breakpod")
