"""Stall watchdog: a training loop that stops stepping is reported, with stacks.

The training loop calls :func:`step` (``breakpod.step()``) once per step;
``Monitor.step`` does it. The first call reads the environment:
``BREAKPOD_STALL_AFTER=SECONDS`` starts the watchdog, and so does debug mode
(``ENABLE_REMOTE_DEBUG=1``) with a timeout of 10x the p99 step time, never
under :data:`DEBUG_FLOOR`. Otherwise every later call costs one global check.

A daemon thread checks the time since the last step. It needs no help from
the stuck thread: blocked in C (a lock, ``Event.wait()``, a collective) the
main thread has released the GIL, and spinning in Python it hands it over
every switch interval. Past the timeout the thread prints this rank's stacks,
emits a ``stall`` event, and (``action="inspect"``) opens a remote pdb on the
main thread's frame. In a distributed job each rank also publishes its status
on the job's rank board (``_job/board.py``) and rank 0 prints one job-wide report
naming the culprit rank (``stall_report.py``). A stall is reported once; when
steps resume, a ``resumed`` event and one line follow.

In debug mode a distributed job's watchdog also runs the job pause
(``_job/pause.py``): a parked peer pauses this rank at its next step boundary,
and the process group's own timeout (``_job/timeouts.py``) is enforced here
while no rank is parked: a collective that makes no progress for that long is
a stall, reported, then this rank exits with status 1 as torch would have.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from breakpod import protocol
from breakpod._core import events, holding, wiring
from breakpod._core.announce import announce
from breakpod._core.config import ENV
from breakpod._core.errors import ConfigError
from breakpod._debug import shim
from breakpod._debug.remote_pdb import inspect_remote
from breakpod._job import board as job
from breakpod._job import collectives, stall_report, thread_stacks
from breakpod._job import pause as job_pause
from breakpod._job import timeouts as job_timeouts

log = logging.getLogger(__name__)
ACTIONS = ("dump", "inspect")
STALL_AFTER_ENV = "BREAKPOD_STALL_AFTER"
DEBUG_FLOOR = 60.0  # debug mode's default timeout until the step times say more
DEBUG_FACTOR = 10.0  # x the p99 step time
STACKS_WAIT = 5.0  # rank 0 waits this long for the culprit's stacks
RECONNECT_SECONDS = 10.0
PAUSE_INTERVAL = 0.5  # a parked peer is noticed within this (plus its own tick)
EXIT_GRACE = 8.0  # after a collective timeout: time for rank 0's job report


class Watchdog:
    """Watches one heartbeat; start it with :func:`watch_stalls` or :func:`step`."""

    def __init__(
        self,
        timeout: float,
        action: str = "dump",
        *,
        adaptive: bool = False,
        after_first_step: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"stall timeout must be positive seconds, got {timeout!r}")
        if action not in ACTIONS:
            raise ValueError(f"stall action {action!r} is not one of: {', '.join(ACTIONS)}")
        self.timeout = timeout
        self.action = action
        self.step: int | None = None
        self.last_beat = time.monotonic()
        self.alive_at = 0.0  # the model's last forward with no step since (an evaluation)
        self.stalls = 0
        self.durations: collections.deque[float] | None = (
            collections.deque(maxlen=512) if adaptive else None
        )
        self.place = job.Place.from_env()
        self.board: job.Board | None = None
        self.job_view_missing: str | None = None
        self.park_unsaid = False  # parked before the store was tried: say "alone" if lost
        self._stalled = False
        self._recovered = False  # set by beat(), taken back to the board by the thread
        self._job_report: dict[str, Any] | None = None  # rank 0: the stall it reported
        self.after_first_step = after_first_step  # no step-silence stall before one step
        self.pause = job_pause.JobPause(self.place) if _pausing(self.place) else None
        self.job_stalled = False  # another rank reported a stall: publish stacks too
        self.exit_at: float | None = None  # a collective timed out: exit then
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="breakpod-watchdog", daemon=True)

    def beat(self, step: int | None = None) -> None:
        now = time.monotonic()
        if self.durations is not None:
            self.durations.append(now - self.last_beat)
        self.last_beat = now
        self.step = step if step is not None else (self.step or 0) + 1
        events.note_step(self.step)
        if self._stalled:
            self._stalled = False
            self._recovered = True
            announce(f"stall over: stepping again at step {self.step}")
            events.emit(protocol.RESUMED, step=self.step, why="heartbeat resumed after a stall")

    def stop(self, wait: float = 0.0) -> None:
        """Stop the thread; with ``wait``, give a tick in progress that long to end."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if wait and thread.is_alive() and thread is not threading.current_thread():
            thread.join(wait)

    def wake(self) -> None:
        self._wake.set()

    def at_boundary(self, frame: FrameType, *, now: bool = False) -> None:
        """Training thread, after the beat: park for a job break (see
        :func:`shim.park_at_step` for ``now``), or wait for a parked peer."""
        pause = self.pause
        if pause is None:
            return
        if pause.parks_at(self.step or 0):
            events.pending_break()  # one park serves a local break asked for meanwhile too
            shim.park_at_step(frame, f"job-wide break at step {self.step}", now=now)
            return
        pause.wait_at_step(self.step or 0)

    def current_timeout(self) -> float:
        """The fixed timeout, or in debug mode 10x the p99 step time (with a floor)."""
        if not self.durations:
            return self.timeout
        ordered = sorted(self.durations)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return max(self.timeout, DEBUG_FACTOR * p99)

    def _run(self) -> None:
        interval = min(self.timeout / 4, 1.0 if self.pause is None else PAUSE_INTERVAL)
        failed = False
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception as e:  # the watchdog must never take the job down
                if not failed:
                    failed = True
                    announce(f"stall watchdog error ({type(e).__name__}: {e}); it keeps watching")

    def _tick(self) -> None:
        if self.pause is not None:
            self._tick_pause(self.pause)
        overdue = self._collective_overdue()
        quiet_since = max(self.last_beat, self.alive_at)  # forwards: evaluating, not stalled
        silent = time.monotonic() - max(quiet_since, self.pause.over_at if self.pause else 0)
        if overdue is not None and not self._stalled:
            self._collective_timeout(overdue)
        elif silent > self.current_timeout() and not self._stalled and not self._held():
            self._stalled = True
            self.stalls += 1
            self._begin_stall(silent)
        elif self.place.distributed:
            self._share(self._record(silent, stacks=self._stalled or self.job_stalled))
        if self.place.rank == 0 and self.board is not None:
            self._coordinate()
        if self.exit_at is not None and time.monotonic() >= self.exit_at:
            _exit_like_torch()

    def _held(self) -> bool:
        """Parked, waiting for a parked peer, or before the first step when asked."""
        return self._parked() or (self.after_first_step and self.step is None)

    def _parked(self) -> bool:
        """This rank or a peer is parked: a collective may wait on it for the whole park
        (a rank that a job-wide break has not reached yet is not paused, and waits)."""
        pause = self.pause
        return holding.is_held() or (pause is not None and (pause.paused or pause.peer_parked))

    def _tick_pause(self, pause: job_pause.JobPause) -> None:
        if self.board is None and not self._connect():
            self._lost(pause)
            return
        assert self.board is not None
        try:
            pause.tick(self.board, holding.is_held(), self.step or 0, self._step_seconds())
            self.job_stalled = self.board.count_stalled() > 0
        except Exception as e:  # the store went away: this rank no longer waits for peers
            self.board, self.job_view_missing = None, f"lost the job store ({type(e).__name__})"
            self._next_connect = time.monotonic() + RECONNECT_SECONDS
            self._lost(pause)

    def _lost(self, pause: job_pause.JobPause) -> None:
        """No job store: stop waiting for peers; a job break asked for meanwhile parks
        this rank alone (it was queued before the first connection was tried), and a
        park that began before that try says now that the job was not paused."""
        if self.park_unsaid and holding.is_held():
            why = self.job_view_missing or "the job store is not reachable"
            announce(f"this rank parks alone: the job was not paused ({why})")
        self.park_unsaid = False
        pause.lost()
        if pause.break_wanted:
            pause.break_wanted = False
            _break_alone(self.job_view_missing or "the job store is not reachable")

    def _step_seconds(self) -> float | None:
        if not self.durations:
            return None
        ordered = sorted(self.durations)
        return ordered[len(ordered) // 2]

    def _collective_overdue(self) -> float | None:
        """Seconds one collective made no progress past the process group's own timeout,
        with no rank parked (debug mode owns that timeout, see job_timeouts)."""
        limit, pause = job_timeouts.user_timeout, self.pause
        progress = collectives.progress
        # not _held(): before the first step a collective (DDP's first broadcast) can hang too
        if limit is None or pause is None or not progress.waiting or self._parked():
            return None
        waited = time.monotonic() - max(progress.changed_at, pause.over_at)
        return waited if waited > limit else None

    def _collective_timeout(self, waited: float) -> None:
        self._stalled = True
        self.stalls += 1
        limit = job_timeouts.user_timeout
        announce(
            f"collective #{collectives.progress.entered} made no progress for {waited:.0f}s, "
            f"past the process group's timeout ({limit:g}s), and no rank is parked"
        )
        self._begin_stall(waited)
        self.exit_at = time.monotonic() + (EXIT_GRACE if self.place.rank != 0 else STACKS_WAIT + 2)

    def _begin_stall(self, silent: float) -> None:
        if not self.place.distributed:
            self._report(silent)
            return
        record = self._record(silent, stacks=True)
        self._share(record, change=1)
        view = self._job_view()
        announce(stall_report.local_report(self.place.rank, record, silent, view))
        if self.board is None or self.place.rank != 0:
            events.emit(
                protocol.STALL,
                seconds=round(silent, 1),
                step=self.step,
                rank=self.place.rank,
                state=record["state"],
                frame=record["frame"],
                stacks=record["stacks"],
            )
        self._maybe_inspect()

    def _job_view(self) -> str:
        if self.board is None:
            return f"no job view: {self.job_view_missing}; this rank reports alone"
        if self.place.rank == 0:
            return "the job-wide report follows on this stderr"
        return "the job-wide report (culprit, every rank) is on rank 0's stderr"

    def _share(self, record: Mapping[str, Any], change: int = 0) -> None:
        """Publish this rank's record; (re)connect to the job's store when needed."""
        if self.board is None and not self._connect():
            return
        assert self.board is not None
        try:
            if self._recovered:
                self._recovered = False
                change -= 1
            if change:
                self.board.count_stalled(change)
            self.board.publish(record)
        except Exception as e:  # the store went away: report locally from now on
            self.board, self.job_view_missing = (
                None,
                f"lost the job store ({type(e).__name__}: {e})",
            )
            self._next_connect = time.monotonic() + RECONNECT_SECONDS

    _next_connect = 0.0

    def _connect(self) -> bool:
        if time.monotonic() < self._next_connect:
            return False
        self._next_connect = time.monotonic() + RECONNECT_SECONDS
        self.board, self.job_view_missing = job.connect(self.place)
        if self.board is None:
            return False
        self.park_unsaid = False  # the park is published at this tick
        return True

    def _record(self, silent: float, *, stacks: bool) -> dict[str, Any]:
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        progress = collectives.progress
        state = (
            protocol.PARKED if holding.is_held() else "collective" if progress.waiting else "user"
        )
        if state == "user" and self.pause is not None and self.pause.paused:
            state = "waiting-for-peer"
        record: dict[str, Any] = {
            "rank": self.place.rank,
            "step": self.step or 0,
            "entered": progress.entered,
            "completed": progress.completed,
            "op": progress.op,
            "state": state,
            "frame": stall_report.where(stall_report.user_frame(main)),
            "stalled": self._stalled,
            "silent": round(silent, 1),
            "time": time.time(),
        }
        if stacks:
            record["stacks"] = format_stacks()
        return record

    def _coordinate(self) -> None:
        """Rank 0: one job-wide report per stall, one line when it is over."""
        assert self.board is not None
        stalled = self.board.count_stalled()
        if stalled <= 0:
            if self._job_report is not None and self._job_report.get("done"):
                announce("stall over: every rank is stepping again")
                events.emit(protocol.RESUMED, scope="job", why="every rank is stepping again")
            self._job_report = None
            return
        if self._job_report is None:
            self._job_report = {"since": time.monotonic()}
        if not self._job_report.get("done"):
            self._try_job_report()

    def _try_job_report(self) -> None:
        assert self.board is not None and self._job_report is not None
        records = self.board.read()
        blamed, _ = stall_report.culprits(records)
        waited = time.monotonic() - self._job_report["since"]
        if any("stacks" not in records[r] for r in blamed) and waited < STACKS_WAIT:
            return  # the culprit publishes its stacks when it notices its own stall
        silent = max((float(r.get("silent", 0)) for r in records.values()), default=0.0)
        text, blamed = stall_report.job_report(records, self.place.world_size, silent)
        announce(text)
        self._job_report["done"] = True
        ranks = [{k: v for k, v in r.items() if k != "stacks"} for r in records.values()]
        stacks = {str(r): records[r].get("stacks") for r in blamed}
        events.emit(
            protocol.STALL,
            scope="job",
            seconds=round(silent, 1),
            culprits=blamed,
            ranks=ranks,
            culprit_stacks=stacks,
            report=text.split("\nstacks of")[0],
        )

    def _report(self, silent: float) -> None:
        stacks = format_stacks()
        where = f"no heartbeat for {silent:.0f}s (last step {self.step})"
        announce(f"stall: {where}; stacks:\n{stacks}")
        events.emit(protocol.STALL, seconds=round(silent, 1), step=self.step, stacks=stacks)
        self._maybe_inspect()

    def _maybe_inspect(self) -> None:
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        if self.action == "inspect" and main is not None:
            _inspect(main, self.step)


_active: Watchdog | None = None
_armed = True  # the first step() reads the environment, then this is False unless watching
_queued_break = False  # a job-wide break asked for before this rank's watchdog started
_env_read = False  # the first step() read the environment (a `break` re-arms, not re-reads)


def suspend() -> None:
    """A debugger holds the process (parked or attached): stop counting silence."""
    holding.hold()


def resume() -> None:
    """The debugger let go: count silence again, from now."""
    holding.release()


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


def hear_parks() -> None:
    """Hear this process's parks (the job's other ranks pause) and each hold's end."""
    holding.on_release(_count_from_now)
    events.add_sink(_hear)


hear_parks()


def note_park(reason: str, frame: FrameType | None) -> None:
    """Before a park: where and why, for the job's other ranks; says when they won't pause."""
    place = _active.place if _active is not None else job.Place.from_env()
    if not place.distributed:
        return
    where = stall_report.where(stall_report.user_frame(frame))
    if _active is not None and _active.pause is not None:
        _active.pause.park_note = job_pause.note_for(reason, where)
        if _active.board is None and _active.job_view_missing is None:  # not tried yet
            _active.park_unsaid = True
        elif _active.board is None:
            announce(f"this rank parks alone: the job was not paused ({_active.job_view_missing})")
        return
    announce(f"this rank parks alone: the job was not paused ({_why_no_pause()})")


JOB_BREAK = "the job parks at a step boundary every rank agrees on"


def request_break() -> str:
    """A broker ``break``: every rank of a job parks at one step it agrees on, or this
    rank alone at its next step boundary; says which."""
    global _queued_break
    place = job.Place.from_env()
    if _active is None and _pausing(place):
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


def _pausing(place: job.Place) -> bool:
    """Whether this rank's watchdog runs the job pause: debug mode, several ranks."""
    return place.distributed and job_timeouts.debug_mode()


def _why_no_pause() -> str:
    if not job_timeouts.debug_mode():
        return f"debug mode is off: {ENV['enabled']}=1 pauses the whole job"
    if _active is None:
        return "no breakpod.step() yet and no process group started"
    return "not a job of several ranks"


def start_for_job() -> None:
    """``init_process_group`` in debug mode: watch collectives before the first step."""
    global _armed
    if _active is None:
        _start_from_env(os.environ, after_first_step=True)
        _armed = True


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
    _active._thread.start()
    _armed = True
    wiring.connect()  # stall events reach the broker when one is set
    return _active


def _stop_at_exit() -> None:
    """No watchdog tick may be inside the job store's C++ client when the interpreter
    ends: a daemon thread that wakes there during finalization aborts the process
    (``terminate called without an active exception``, SIGABRT after a clean run)."""
    if _active is not None:
        _active.stop(wait=job.CONNECT_SECONDS + 1.0)


def step(number: int | None = None) -> None:
    """Mark a training step boundary (``breakpod.step()``); one global check when off.
    Parks here after a ``break`` command."""
    if _armed:
        frame = sys._getframe(1)
        _step(number, frame)
        shim.take_break(frame)


def boundary(number: int, frame: FrameType, *, now: bool = False) -> None:
    """A monitor's step boundary: as :func:`step`, but the monitor takes a ``break``
    itself (``now``: see :func:`shim.park_at_step`)."""
    if _armed:
        _step(number, frame, now=now)


def join_job_break(frame: FrameType) -> None:
    """``break_if_requested()`` in a job that pauses as one: a step boundary as
    :func:`step`'s, where a job-wide break parks (a loop that calls only
    ``break_if_requested()`` would never reach one)."""
    active = _active
    if active is not None and active.pause is not None:
        _step(None, frame)


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
            _active.at_boundary(frame, now=now)


def _start_from_env(env: Mapping[str, str], *, after_first_step: bool = False) -> None:
    try:
        chosen = stall_timeout_from_env(env)
    except ConfigError as e:
        announce(f"{e}; stall detection is off")
        return
    if chosen is not None:
        watch_stalls(chosen[0], adaptive=chosen[1], after_first_step=after_first_step)


def stall_timeout_from_env(env: Mapping[str, str]) -> tuple[float, bool] | None:
    """(seconds, adaptive) from BREAKPOD_STALL_AFTER or debug mode; None when off."""
    raw = env.get(STALL_AFTER_ENV, "").strip()
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not seconds > 0 or seconds == float("inf"):
            raise ConfigError(
                f"{STALL_AFTER_ENV}={raw!r} is not a positive number of seconds: use e.g. 300"
            )
        return seconds, False
    if job_timeouts.debug_mode(env):
        return DEBUG_FLOOR, True
    return None


def heartbeat(step: int | None = None) -> None:
    """Mark the training loop alive; free when no watchdog runs."""
    if _active is not None:
        _active.beat(step)


def format_stacks() -> str:
    """Every thread's Python stack, innermost call last: the user's threads first,
    breakpod's own folded into one last line (``breakpod stacks --pid`` prints the same)."""
    return thread_stacks.format_threads(thread_stacks.current())


def _inspect(frame: FrameType, step: int | None) -> None:
    reason = f"stall at step {step}: main thread at {shim.where(frame)}"
    settings = shim.env_settings()
    session = shim.open_session(settings, reason, settings.hold_seconds)
    if session is not None:
        inspect_remote(session, frame, quit_mode="detach")  # not protocol: a pdb quit mode


def _exit_like_torch() -> None:
    """The process group's own timeout passed: end this rank as torch would have."""
    announce("exiting with status 1, as the process group's timeout would have")
    try:
        wiring.flush(2.0)  # the stall event reaches the broker first
        wiring.finish({"exit": 1})  # os._exit skips the exit handler that would say so
    finally:
        os._exit(1)
