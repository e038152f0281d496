"""Stall reports: who the culprit is, and the text every rank and the broker get.

Pure functions over the rank board's records (see ``_job/board.py``). The culprit is
the rank(s) that did not enter the collective the others wait in; when no rank
waits in one, the rank(s) with the lowest step counter; when every rank is
level, nobody is blamed (a healthy rank is never named).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Mapping
from types import FrameType
from typing import Any

from breakpod import protocol
from breakpod._core import holding

Record = Mapping[str, Any]
_LIBRARY_DIRS = tuple(
    os.path.normcase(os.path.realpath(p)) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_OWN_PACKAGES = ("breakpod", "torch")


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of user code (not the stdlib, site-packages, torch, breakpod)."""
    innermost = frame
    while frame is not None and _library(frame):
        frame = frame.f_back
    return frame or innermost


def stopped_where(frame: FrameType | None) -> str:
    """Where the process stands, from ``frame`` of its thread: the user's frame, or the
    frame a post-mortem holds, which an excepthook's stack no longer holds."""
    return where(user_frame(holding.stopped_frame() or frame))


def where(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )


def stack_of(frame: FrameType) -> str:
    return "".join(traceback.format_stack(frame))


def culprits(records: Mapping[int, Record]) -> tuple[list[int], str]:
    """The ranks the job waits for, and why they are blamed ('' when nobody is)."""
    waiting = {r: rec for r, rec in records.items() if rec.get("state") == "collective"}
    if waiting:
        target = max(rec["entered"] for rec in waiting.values())
        behind = sorted(r for r, rec in records.items() if rec["entered"] < target)
        if behind:
            others = [r for r in sorted(waiting) if r not in behind]
            return behind, f"not in collective #{target} that {who_waits(others)} in"
        return [], f"every rank is inside collective #{target}"
    steps = {rec["step"] for rec in records.values()}
    if len(steps) > 1:
        low = min(steps)
        return sorted(r for r, rec in records.items() if rec["step"] == low), "slowest step counter"
    return [], "every rank is at the same step and none is in a collective"


def who_waits(ranks: list[int]) -> str:
    """``rank 0 waits`` / ``ranks 0, 2 wait``: the culprit line's grammar."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} waits"
    return f"ranks {', '.join(map(str, ranks))} wait"


def state_text(record: Record) -> str:
    state = record.get("state")
    if state == "collective":
        return f"in collective #{record['entered']} ({record.get('op') or '?'})"
    if state == "waiting-for-peer":
        return "waiting for a parked rank"
    return protocol.PARKED if state == protocol.PARKED else "in user code"


def rank_line(rank: int, record: Record) -> str:
    return (
        f"rank {rank}: step {record['step']}, {state_text(record)}, at {record.get('frame', '?')}"
    )


def job_report(
    records: Mapping[int, Record], world_size: int, silent: float
) -> tuple[str, list[int]]:
    """The job-wide report (rank 0's stderr); returns it with the culprit ranks."""
    blamed, why = culprits(records)
    missing = [r for r in range(world_size) if r not in records]
    lines = [f"stall: the job has made no progress for {silent:.0f}s ({world_size} ranks)"]
    if blamed:
        first = records[blamed[0]]
        names = ", ".join(f"rank {r}" for r in blamed)
        lines.append(f"culprit: {names} (step {first['step']}, {why}) at {first.get('frame', '?')}")
    else:
        lines.append(f"culprit: none found ({why})")
    lines += [rank_line(r, records[r]) for r in sorted(records)]
    lines += [
        f"rank {r}: no status published (not started, dead, or cannot reach the store)"
        for r in missing
    ]
    for r in blamed:
        stacks = records[r].get("stacks")
        lines.append(
            f"stacks of rank {r}:\n{stacks}" if stacks else f"stacks of rank {r}: not published yet"
        )
    return "\n".join(lines), blamed


def local_report(rank: int, record: Record, silent: float, job_view: str) -> str:
    """What each rank prints on its own stderr: its state and its own stacks."""
    state = f"step {record['step']}, {state_text(record)}, at {record.get('frame', '?')}"
    head = f"stall: rank {rank}: no step for {silent:.0f}s; {state}"
    return f"{head}\n{job_view}\nstacks of rank {rank}:\n{record.get('stacks', '')}"


def _library(frame: FrameType) -> bool:
    package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
    if package in _OWN_PACKAGES:
        return True
    path = os.path.normcase(os.path.realpath(frame.f_code.co_filename))
    return path.startswith(_LIBRARY_DIRS) or frame.f_code.co_filename.startswith("<frozen")
