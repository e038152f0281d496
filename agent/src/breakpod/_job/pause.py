"""One parked rank pauses the whole job; the job resumes when it does.

Ticked from the stall watchdog's thread (debug mode, distributed jobs only),
through the rank board in the job's own store (``_job/board.py``):

* this rank parks (a debugger holds it): it adds 1 to ``.../parked`` and writes
  where and why under ``.../park/<rank>``; when it resumes it takes the 1 back;
* another rank parks: this rank says so once on its stderr, emits ``waiting``,
  and its next ``breakpod.step()`` waits until no rank is parked; a rank inside
  a collective simply keeps waiting there (the process group's timeout is
  long in debug mode, see ``_job/timeouts.py``);
* a job-wide break (``breakpod send JOB break``): the first rank that gets the
  command writes ``.../break`` with a step a little ahead of every rank's; each
  rank parks at that step boundary; the first rank to resume marks it over and
  the ranks still waiting for a debugger stop waiting. A rank that already passed
  that step when it heard of the break (its tick came late, or it waits in a
  collective behind a parked peer) moves the break past its own step, and the
  ranks parked at the old one continue to the new one.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from breakpod import protocol
from breakpod._core import events
from breakpod._core.announce import announce
from breakpod._debug import debugger
from breakpod._job import board as job

BREAK_AHEAD_SECONDS = 2.0  # the agreed break step lies this far ahead of the fastest rank
MAX_BREAK_AHEAD = 1000  # steps
BREAK_KEY = "break"  # the board key of a job-wide break
# A parked peer's watchdog publishes its record every tick, debugger or not; one whose
# record has not changed for this long is gone (killed), and nobody waits for it.
PEER_SILENT = 30.0  # seconds, of this rank's clock
LOOK_EVERY = 5.0  # seconds between looks at the parked peers' records


class JobPause:
    """This rank's side of job pauses; all methods but :meth:`wait_at_step` run in the
    watchdog thread."""

    def __init__(self, place: job.Place) -> None:
        self.place = place
        self.released = threading.Event()
        self.released.set()
        self.peers: list[int] = []  # ranks parked now, other than this one
        self.published = False  # this rank's 1 is in the parked counter
        self.park_note: dict[str, Any] = {}  # where and why this rank parks
        self.over_at = 0.0  # when the last pause ended (monotonic)
        self.break_wanted = False  # a `break` command arrived: propose a job break
        self.break_seen: dict[str, Any] | None = None
        self.break_at: int | None = None  # park at this step boundary
        self.parked_for: int | None = None  # the job break this rank parks for
        self.break_done: int | None = None  # the job break this rank resumed from
        self.passed = -1  # the last step boundary the training thread passed
        self.lock = threading.Lock()  # break_at and passed change together
        # a peer is parked (a collective may wait on it, paused or not: see watchdog)
        self.peer_parked = False
        self.gone: set[int] = set()  # parked peers that stopped publishing: not waited for
        self._heard: dict[int, tuple[Any, float]] = {}  # rank -> (record time, seen at)
        self._looked = 0.0

    @property
    def paused(self) -> bool:
        return not self.released.is_set()

    def tick(self, board: job.Board, parked: bool, step: int, speed: float | None) -> None:
        self._publish(board, parked, step)
        self._follow_break(board, step, speed)
        self._notice_peers(board, parked, step)

    def lost(self) -> None:
        """The store went away: never keep a rank waiting for a pause nobody can end."""
        if self.paused:
            announce("lost the job store: this rank stops waiting for its peers")
            self._release()
        self.published = False

    def wait_at_step(self, step: int) -> None:
        """Training thread, at a step boundary: wait while a peer is parked."""
        if not self.paused:
            return
        events.emit(protocol.WAITING, step=step, ranks=self.peers, why="waiting for a parked rank")
        self.released.wait()

    def _publish(self, board: job.Board, parked: bool, step: int) -> None:
        if parked == self.published:
            return
        for_break = self.parked_for if self.break_at is None else None
        # resumed: the note goes, or peers would name this rank as parked at later pauses
        note = {**self.park_note, "step": step, "break": for_break} if parked else {}
        board.put(f"park/{self.place.rank}", note)
        board.count_parked(1 if parked else -1)
        self.published = parked

    def _notice_peers(self, board: job.Board, parked: bool, step: int) -> None:
        others = board.count_parked() - (1 if self.published else 0)
        gone = self._look(board) if others > 0 or self.gone else []
        others -= len(self.gone)  # their 1s stay in the counter: nobody takes them back
        if self.peer_parked and others <= 0:  # a collective's wait counts from now
            self.over_at = time.monotonic()
        self.peer_parked = others > 0
        if others > 0 and not self.paused and not parked and self.break_at is None:
            self._pause(board, step)
        elif others <= 0 and self.paused:
            if not gone:  # said by _look
                announce(f"rank {_names(self.peers)} resumed; this rank continues")
            why = "the parked rank stopped reporting" if gone else "the parked rank resumed"
            events.emit(protocol.RESUMED, step=step, why=why)
            self._release()

    def _look(self, board: job.Board) -> list[int]:
        """Parked peers that stopped publishing (killed while parked): from now on nobody
        waits for them; one that publishes again, or no longer reads parked, counts
        again. Judged on this rank's clock (records' times only need to change), every
        LOOK_EVERY seconds; the ranks found gone at this look."""
        now = time.monotonic()
        if now - self._looked < LOOK_EVERY:
            return []
        self._looked = now
        silent = []
        for rank, record in board.read().items():
            if rank == self.place.rank:
                continue
            heard, seen_at = self._heard.get(rank, (None, now))
            if record.get("time") != heard:
                heard, seen_at = record.get("time"), now
            self._heard[rank] = (heard, seen_at)
            if record.get("state") != protocol.PARKED or now - seen_at <= PEER_SILENT:
                self.gone.discard(rank)
            elif rank not in self.gone:
                silent.append(rank)
        if silent:
            self.gone.update(silent)
            announce(
                f"rank {_names(silent)} stopped reporting while parked (over "
                f"{PEER_SILENT:g}s): this rank stops waiting for it"
            )
        return silent

    def _pause(self, board: job.Board, step: int) -> None:
        notes = {r: board.get(f"park/{r}") for r in range(self.place.world_size)}
        over = (self.break_seen or {}).get("id") if (self.break_seen or {}).get("over") else None
        self.peers = [
            r
            for r, n in notes.items()
            if n
            and r != self.place.rank
            and r not in self.gone
            and (over is None or n.get(BREAK_KEY) != over)
        ]
        if not self.peers:  # only ranks of a finished job break, about to continue
            return
        where = "; ".join(
            f"rank {r} parked at {notes[r].get('where', '?')} ({notes[r].get('why', '?')})"  # type: ignore[union-attr]
            for r in self.peers
        )
        announce(f"{where or 'a rank parked'}; this rank waits at step {step}")
        events.emit(protocol.WAITING, step=step, ranks=self.peers, why=where or "a rank parked")
        self.released.clear()

    def _release(self) -> None:
        self.over_at = time.monotonic()
        self.released.set()

    def parks_at(self, step: int) -> bool:
        """Training thread, at a step boundary: park here for a job break? If not, this
        step is passed, and the watchdog moves a break it learns of later beyond it."""
        with self.lock:
            if self.break_at is not None and step >= self.break_at:
                self.break_at = None
                return True
            self.passed = step
            return False

    def _follow_break(self, board: job.Board, step: int, speed: float | None) -> None:
        current = board.get(BREAK_KEY)
        if self.break_wanted:
            if current is None or current.get("over"):
                current = self._propose_break(board, current, step, speed)
            self.break_wanted = False  # once proposed: a store lost meanwhile parks it alone
        if self.break_done is not None and current and current["id"] == self.break_done:
            if not current.get("over"):
                current = board.replace(BREAK_KEY, current, {**current, "over": True})
            self.break_done = None
        if current is None or current == self.break_seen:
            return
        self.break_seen = current
        if current.get("over"):
            if self.parked_for == current["id"] and self.break_at is None:
                # parked for it: stop waiting for a client
                _stop_waiting_for_debugger("the job-wide break is over")
            self.break_at = self.parked_for = None
            return
        parked = self.parked_for == current["id"] and self.break_at is None
        with self.lock:  # decided against the training thread's last boundary, not a guess
            late = self.passed >= current["step"]
            target = self.passed + _ahead(speed) if late else current["step"]
            self.break_at, self.parked_for = target, current["id"]
        if late:
            self._move_break(board, current, target)
        elif parked:  # the break moved on while this rank waited for a client: follow it
            _stop_waiting_for_debugger(f"the job-wide break moved to step {target}")

    def _move_break(self, board: job.Board, current: dict[str, Any], target: int) -> None:
        """This rank passed the agreed step before it heard of the break (a slow tick, or
        blocked in a collective behind a parked peer): every rank parks at ``target``."""
        announce(
            f"this rank passed step {current['step']} before it heard of the job-wide break; "
            f"the break moves to step {target}"
        )
        now = board.replace(BREAK_KEY, current, {**current, "step": target})
        if now["step"] != target:
            self.break_seen = None  # another rank moved it first: follow that at the next tick

    def _propose_break(
        self, board: job.Board, seen: dict[str, Any] | None, step: int, speed: float | None
    ) -> dict[str, Any]:
        steps = [int(r.get("step", 0)) for r in board.read().values()] or [step]
        number = (seen or {}).get("id", 0) + 1
        proposal = {"id": number, "step": max([*steps, step]) + _ahead(speed), "over": False}
        return board.replace(BREAK_KEY, seen, proposal)


def _ahead(speed: float | None) -> int:
    """Steps from the fastest rank to a break: about BREAK_AHEAD_SECONDS of them."""
    return 1 if not speed else min(MAX_BREAK_AHEAD, math.ceil(BREAK_AHEAD_SECONDS / speed) + 1)


def note_for(reason: str, where: str) -> dict[str, str]:
    """Where and why a rank parks, as its peers print it."""
    head = reason.split(":")[0].split(" at ")[0].strip()
    if reason.startswith("break requested"):
        why = "break"
    elif head.startswith("breakpoint()"):
        why = "breakpoint"
    else:
        why = head or "parked"
    return {"where": where, "why": why}


def _names(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks) or "?"


def _stop_waiting_for_debugger(why: str) -> None:
    """The job break is over: a rank still waiting for a client continues (an attached
    client is left alone: its engineer continues it)."""
    listener = debugger.active_pdb_listener()
    if listener is not None:
        listener.interrupt(why)
