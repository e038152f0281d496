"""Stall watchdog: a training loop that stops beating is reported, with stacks.

The training loop calls :func:`heartbeat` once per step (``Monitor.step``
does it). A daemon thread checks the time since the last beat; past the
timeout it prints every thread's Python stack, emits a ``stall`` event, and
(``action="inspect"``) opens a remote pdb on the main thread's current frame
so an engineer can look at the locals of whatever is stuck: an NCCL
collective, a dataloader ``get``, a CUDA wait. The stuck thread itself cannot
be stopped from outside, so the session is for inspection; ``c`` ends it.
When beats resume, a ``resumed`` event follows (the session is running again).

Disabled (no watchdog started) a heartbeat costs one global lookup.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from types import FrameType

from breakpod import emitter, events
from breakpod.announce import announce

ACTIONS = ("dump", "inspect")


class Watchdog:
    """Watches one heartbeat; start it with :func:`watch_stalls`."""

    def __init__(self, timeout: float, action: str = "dump") -> None:
        if timeout <= 0:
            raise ValueError(f"stall timeout must be positive seconds, got {timeout!r}")
        if action not in ACTIONS:
            raise ValueError(f"stall action {action!r} is not one of: {', '.join(ACTIONS)}")
        self.timeout = timeout
        self.action = action
        self.step: int | None = None
        self.last_beat = time.monotonic()
        self.stalls = 0
        self._stalled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="breakpod-watchdog", daemon=True)

    def beat(self, step: int | None = None) -> None:
        self.last_beat = time.monotonic()
        if step is not None:
            self.step = step
        if self._stalled:
            self._stalled = False
            announce(f"heartbeat resumed at step {self.step}; the stall is over")
            events.emit("resumed", step=self.step, why="heartbeat resumed after a stall")

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = min(self.timeout / 4, 5.0)
        while not self._stop.wait(interval):
            silent = time.monotonic() - self.last_beat
            if silent > self.timeout and not self._stalled and not _suspended:
                self._stalled = True
                self.stalls += 1
                try:
                    self._report(silent)
                except Exception as e:  # the watchdog must never take the job down
                    announce(f"stall report failed ({type(e).__name__}: {e})")

    def _report(self, silent: float) -> None:
        stacks = format_stacks()
        where = f"no heartbeat for {silent:.0f}s (last step {self.step})"
        announce(f"stall: {where}; stacks:\n{stacks}")
        events.emit("stall", seconds=round(silent, 1), step=self.step, stacks=stacks)
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        if self.action == "inspect" and main is not None:
            _inspect(main, self.step)


_active: Watchdog | None = None
_suspended = 0  # debugger sessions holding the process: a park is not a stall
_suspend_lock = threading.Lock()


def suspend() -> None:
    """A debugger holds the process (parked or attached): stop counting silence."""
    global _suspended
    with _suspend_lock:
        _suspended += 1


def resume() -> None:
    """The debugger let go: count silence again, from now."""
    global _suspended
    with _suspend_lock:
        _suspended = max(0, _suspended - 1)
    if _active is not None:
        _active.last_beat = time.monotonic()


def watch_stalls(timeout: float, *, action: str = "dump") -> Watchdog:
    """Start (or replace) the process's stall watchdog."""
    global _active
    if _active is not None:
        _active.stop()
    _active = Watchdog(timeout, action)
    _active._thread.start()
    emitter.ensure_started()  # stall events reach the broker when one is set
    return _active


def heartbeat(step: int | None = None) -> None:
    """Mark the training loop alive; free when no watchdog runs."""
    if _active is not None:
        _active.beat(step)


def format_stacks() -> str:
    """Every thread's Python stack, named, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "breakpod-watchdog":
            continue
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f'Thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(blocks)


def _inspect(frame: FrameType, step: int | None) -> None:
    from breakpod import shim
    from breakpod.remote_pdb import inspect_remote

    reason = f"stall at step {step}: main thread at {shim.where(frame)}"
    settings = shim.env_settings()
    session = shim.open_session(settings, reason, settings.hold_seconds)
    if session is not None:
        inspect_remote(session, frame, quit_mode="detach")
