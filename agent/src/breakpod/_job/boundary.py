"""The training loop's step boundary: where a step ends, a ``break`` parks, the job pauses.

Every step boundary ends here: ``breakpod.step()`` (:func:`step`), a monitor's
(:func:`boundary`), ``breakpod.break_if_requested()`` and the optimizer's step
hook (``optimizer_steps.py``). At a boundary the stall watchdog hears the beat
(``watchdog.py``: the thread, which needs no help from this one), a ``break``
asked for parks (:func:`request_break` arms it), and in a job that pauses as one
(debug mode, several ranks; ``pause.py``) this rank parks at the step its ranks
agreed on, or waits while a peer is parked.

The first boundary reads the environment (``BREAKPOD_STALL_AFTER``, debug mode)
and may start the watchdog; after that, with none running, each costs one
global check.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Mapping
from types import FrameType

from breakpod import protocol
from breakpod._core import events, holding, wiring
from breakpod._core.announce import announce
from breakpod._core.config import ENV
from breakpod._core.errors import ConfigError
from breakpod._debug import breakpoints
from breakpod._job import board as job
from breakpod._job import collectives, stall_report
from breakpod._job import pause as job_pause
from breakpod._job import timeouts as job_timeouts
from breakpod._job.watchdog import Watchdog, pauses_job, stall_timeout_from_env

_active: Watchdog | None = None
_armed = True  # the first step() reads the environment, then this is False unless watching
_queued_break = False  # a job-wide break asked for before this rank's watchdog started
_env_read = False  # the first step() read the environment (a `break` re-arms, not re-reads)

BREAK_HEADER = "break requested through the broker"  # the banner of a `break`'s park


def active() -> Watchdog | None:
    """The process's stall watchdog, when one runs."""
    return _active


# -- the boundaries -----------------------------------------------------------------


def step(number: int | None = None) -> None:
    """Mark a training step boundary (``breakpod.step()``); one global check when off.
    Parks here after a ``break`` command."""
    if _armed:
        frame = sys._getframe(1)
        _step(number, frame)
        _take_break(frame)


def boundary(number: int, frame: FrameType, *, now: bool = False) -> None:
    """A monitor's step boundary (or the optimizer hook's): the beat, a job-wide break
    or pause, then a ``break`` parks in ``frame``: from its next line, or ``now`` when
    the boundary runs inside torch (the optimizer's step pre-hook), where a debugger
    tracing from the next line would stop in torch's code first."""
    if _armed:
        _step(number, frame, now=now)
    _take_break(frame, now=now)


def break_if_requested(frame: FrameType | None = None) -> None:
    """Call at a step boundary of your own loop: after a ``break`` command
    (``breakpod send SESSION break``) it parks in ``frame`` (default: the caller).
    In a job that pauses as one (debug mode, several ranks) it is a step boundary as
    ``breakpod.step()``'s, where a job-wide break parks: call one of the two. Costs
    a few lookups otherwise; ``breakpod.watch()`` monitors do the same for you."""
    frame = frame if frame is not None else sys._getframe(1)
    if _active is not None and _active.pause is not None:
        _step(None, frame)  # a loop that calls only this would never reach a job break
    _take_break(frame)


def heartbeat(step: int | None = None) -> None:
    """Mark the training loop alive; free when no watchdog runs."""
    if _active is not None:
        _active.beat(step)


def _take_break(frame: FrameType, *, now: bool = False) -> None:
    """Park here if a ``break`` command asked (one flag check)."""
    if events.pending_break():
        _park(frame, BREAK_HEADER, now=now)


def _park(frame: FrameType, header: str, *, now: bool) -> None:
    if now:
        breakpoints.hold(frame, header)
    else:
        breakpoints.set_trace(frame=frame, header=header)


def _step(number: int | None, frame: FrameType, *, now: bool = False) -> None:
    global _armed, _env_read
    if _active is None:
        _armed = False
        if not _env_read:
            _env_read = True
            _start_from_env(os.environ)
            # with BREAKPOD_BROKER_URL set, the loop is reachable without a watchdog or
            # a park: it registers, and `breakpod send JOB break` parks it at a step
            wiring.connect()
    if _active is not None:
        _active.beat(number)
        if _active.pause is not None:
            _job_boundary(_active, _active.pause, frame, now=now)


def _job_boundary(
    active: Watchdog, pause: job_pause.JobPause, frame: FrameType, *, now: bool
) -> None:
    """After the beat: park for a job break, or wait for a parked peer."""
    if pause.parks_at(active.step or 0):
        events.pending_break()  # one park serves a local break asked for meanwhile too
        _park(frame, f"job-wide break at step {active.step}", now=now)
        return
    pause.wait_at_step(active.step or 0)


# -- starting the watchdog ------------------------------------------------------------


def watch_stalls(
    timeout: float,
    *,
    action: str = "dump",
    adaptive: bool = False,
    after_first_step: bool = False,
) -> Watchdog:
    """Start (or replace) the process's stall watchdog."""
    global _active, _armed, _queued_break
    before = _active
    if before is not None:
        before.stop()
    else:
        atexit.register(_stop_at_exit)
    _active = Watchdog(timeout, action, adaptive=adaptive, after_first_step=after_first_step)
    if _active.pause is not None:  # a break queued before it started, or in the one replaced
        replaced = before is not None and before.pause is not None and before.pause.break_wanted
        _active.pause.break_wanted = replaced or _queued_break
    _queued_break = False
    if _active.place.distributed:
        collectives.install()
    hear_parks()
    _active.start()
    _armed = True
    wiring.connect()  # stall events reach the broker when one is set
    return _active


def start_for_job() -> None:
    """``init_process_group`` in debug mode: watch collectives before the first step."""
    global _armed
    if _active is None:
        _start_from_env(os.environ, after_first_step=True)
        _armed = True


def _start_from_env(env: Mapping[str, str], *, after_first_step: bool = False) -> None:
    try:
        chosen = stall_timeout_from_env(env)
    except ConfigError as e:
        announce(f"{e}; stall detection is off")
        return
    if chosen is not None:
        watch_stalls(chosen[0], adaptive=chosen[1], after_first_step=after_first_step)


def _stop_at_exit() -> None:
    """No watchdog tick may be inside the job store's C++ client when the interpreter
    ends: a daemon thread that wakes there during finalization aborts the process
    (``terminate called without an active exception``, SIGABRT after a clean run)."""
    if _active is not None:
        _active.stop(wait=job.CONNECT_SECONDS + 1.0)


# -- parks: the job's other ranks pause, and silence counts from each hold's end ------


def hear_parks() -> None:
    """Hear this process's parks (the job's other ranks pause) and each hold's end."""
    holding.on_release(_count_from_now)
    events.add_sink(_hear)


def _count_from_now() -> None:
    if _active is not None:
        _active.last_beat = time.monotonic()
        pause = _active.pause
        if pause is not None and pause.parked_for is not None and pause.break_at is None:
            pause.break_done, pause.parked_for = pause.parked_for, None  # the job break is over
        _active.wake()


def _hear(event: events.Event) -> None:
    """The hub's ``parked`` events: this rank parks, so the job's other ranks pause."""
    if event.kind == protocol.PARKED:
        note_park(str(event.fields.get("reason", "")), sys._getframe(1))
        if _active is not None:
            _active.wake()  # peers learn of the park now, not at the next tick


def note_park(reason: str, frame: FrameType | None) -> None:
    """Before a park: where and why, for the job's other ranks; says when they won't pause."""
    place = _active.place if _active is not None else job.Place.from_env()
    if not place.distributed:
        return
    where = stall_report.stopped_where(frame)
    if _active is not None and _active.pause is not None:
        _active.pause.park_note = job_pause.note_for(reason, where)
        if _active.board is None and _active.job_view_missing is None:  # not tried yet
            _active.park_unsaid = True
        elif _active.board is None:
            announce(f"this rank parks alone: the job was not paused ({_active.job_view_missing})")
        return
    announce(f"this rank parks alone: the job was not paused ({_why_no_pause()})")


# -- a broker `break` -------------------------------------------------------------------

JOB_BREAK = "the job parks at a step boundary every rank agrees on"


def request_break() -> str:
    """A broker ``break``: every rank of a job parks at one step it agrees on, or this
    rank alone at its next step boundary; says which."""
    global _queued_break
    place = job.Place.from_env()
    if _active is None and pauses_job(place):
        _queued_break = True  # the job is starting: its process group starts the watchdog
        if _active is None:  # else it started meanwhile, maybe without the flag: as below
            return f"{JOB_BREAK}, once its ranks connect"
        _queued_break = False
    active = _active
    if active is not None and active.pause is not None:
        if active.board is not None or active.job_view_missing is None:
            # connected, or the first connection is not tried yet (a break that arrives
            # as the job starts): the watchdog thread proposes it, or parks this rank
            # alone if the store turns out unreachable
            active.pause.break_wanted = True
            active.wake()
            if active.board is None:
                return f"{JOB_BREAK} (this rank alone if it cannot reach the job's store)"
            return JOB_BREAK
        return _break_alone(active.job_view_missing)
    if place.distributed:
        return _break_alone(_why_no_pause())
    _arm_break()
    return "will park at the next step boundary"


def _break_alone(why: str) -> str:
    _arm_break()
    announce(f"break: this rank parks alone; the job was not paused ({why})")
    return f"will park at the next step boundary; the job was not paused ({why})"


def _arm_break() -> None:
    """The next step boundary parks: breakpod.step()'s, or a monitor's."""
    global _armed
    events.request_break()
    _armed = True


def _why_no_pause() -> str:
    if not job_timeouts.debug_mode():
        return f"debug mode is off: {ENV['enabled']}=1 pauses the whole job"
    if _active is None:
        return "no breakpod.step() yet and no process group started"
    return "not a job of several ranks"
