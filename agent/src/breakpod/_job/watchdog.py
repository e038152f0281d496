"""Stall watchdog: a training loop that stops stepping is reported, with stacks.

This module is the watchdog's thread only. The training loop's step boundary
(``breakpod.step()``, a monitor's step: ``boundary.py``) beats its heartbeat and
starts it: ``BREAKPOD_STALL_AFTER=SECONDS`` does, and so does debug mode
(``ENABLE_REMOTE_DEBUG=1``) with a timeout of 10x the p99 step time, never
under :data:`DEBUG_FLOOR` (:func:`stall_timeout_from_env`).

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
(``_job/pause.py``): a parked peer pauses this rank at its next step boundary
(where ``boundary.py`` waits),
and the process group's own timeout (``_job/timeouts.py``) is enforced here
while no rank is parked: a collective that makes no progress for that long is
a stall, reported, then this rank exits with status 1 as torch would have.
"""

from __future__ import annotations

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
from breakpod._core import events, holding, threads, wiring
from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError
from breakpod._debug import breakpoints
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
    """Watches one heartbeat (``boundary.watch_stalls`` starts the process's)."""

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
        self.pause = job_pause.JobPause(self.place) if pauses_job(self.place) else None
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

    def start(self) -> None:
        threads.start(self._thread)

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
        if pause.break_wanted:  # the boundary is armed while a watchdog runs: it parks
            pause.break_wanted = False
            events.request_break()
            why = self.job_view_missing or "the job store is not reachable"
            announce(f"break: this rank parks alone; the job was not paused ({why})")

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
            "frame": stall_report.stopped_where(main),
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


def pauses_job(place: job.Place) -> bool:
    """Whether this rank's watchdog runs the job pause: debug mode, several ranks."""
    return place.distributed and job_timeouts.debug_mode()


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


def format_stacks() -> str:
    """Every thread's Python stack, innermost call last: the user's threads first,
    breakpod's own folded into one last line (``breakpod stacks --pid`` prints the same)."""
    return thread_stacks.format_threads(thread_stacks.current())


def _inspect(frame: FrameType, step: int | None) -> None:
    breakpoints.inspect(frame, f"stall at step {step}: main thread at {breakpoints.where(frame)}")


def _exit_like_torch() -> None:
    """The process group's own timeout passed: end this rank as torch would have."""
    announce("exiting with status 1, as the process group's timeout would have")
    try:
        wiring.flush(2.0)  # the stall event reaches the broker first
        wiring.finish({"exit": 1})  # os._exit skips the exit handler that would say so
    finally:
        os._exit(1)
