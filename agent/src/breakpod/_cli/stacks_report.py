"""The job report of ``breakpod stacks``: where each rank is, and who the job waits for.

Pure functions over each process's threads (``_job/thread_stacks``), however they
were read: py-spy from outside (``--pid``, ``pod/``, ``container:``) or the agent
itself (``breakpod stacks JOB`` through the broker). A rank's place is its main
thread's: inside a collective (a ``torch.distributed`` frame, DDP's reducer, a
c10d/gloo/NCCL native frame), in backward, or in user code, at its innermost
user frame. The culprit is the ranks not in the collective the others wait in;
when no rank waits in one, or all wait in the same one, nobody is blamed (a
snapshot cannot tell a slow rank from a healthy one).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from breakpod._job.thread_stacks import Frame, Thread, format_threads, parse

COLLECTIVE = "collective"
BACKWARD = "backward"
USER = "user code"
UNREAD = "unread"
_DIST_PATHS = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")
_NOT_COLLECTIVE = ("/torch/distributed/elastic/",)  # the launcher's agent, not a rank's wait
_NATIVE_COLLECTIVE = re.compile(r"c10d::|ProcessGroup|gloo::|nccl|Reducer")
_AUTOGRAD = "/torch/autograd/"


@dataclass
class Process:
    """One dumped process: a rank of a job, or a lone process (``rank`` None)."""

    pid: int
    threads: list[Thread] = field(default_factory=list)
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    launcher: int | None = None
    error: str | None = None  # why its stacks could not be read, one line
    host: str = ""  # the pod or container it runs in, when not this machine
    # the collective that native frames showed on another rank at the same place in
    # backward (one rank of each place is read natively: seconds each)
    seen_natively: str = ""

    @property
    def label(self) -> str:
        where = f" in {self.host}" if self.host else ""
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}{where}"


@dataclass(frozen=True)
class Place:
    state: str  # COLLECTIVE, BACKWARD, USER or UNREAD
    op: str = ""  # the collective, e.g. all_reduce, or DDP's gradient all_reduce
    frame: str = "?"  # innermost user frame, file:line in function


def main_thread(threads: Sequence[Thread]) -> Thread | None:
    users = [t for t in threads if not t.own]
    return next((t for t in users if t.name == "MainThread"), users[0] if users else None)


def place(process: Process) -> Place:
    thread = main_thread(process.threads)
    if process.error or thread is None:
        return Place(UNREAD)
    user = thread.user_frame()
    where = user.where if user else "?"
    op = collective_op(thread.frames)
    if op:
        return Place(COLLECTIVE, op, where)
    if any(_AUTOGRAD in f.filename for f in thread.frames if not f.native):
        if process.seen_natively:
            return Place(COLLECTIVE, process.seen_natively, where)
        return Place(BACKWARD, "", where)
    return Place(USER, "", where)


def collective_op(frames: Sequence[Frame]) -> str:
    """The collective the innermost frames wait in, '' when none: the search stops at
    the first frame of user code (a model's forward called by DDP's is not DDP's)."""
    for f in reversed(frames):
        if f.native and _NATIVE_COLLECTIVE.search(f.function):
            return "DDP's gradient all_reduce" if "Reducer" in f.function else f.function
        if not f.native and _is_dist(f.filename):
            return f.function.rsplit(".", 1)[-1]
        if not f.library:
            return ""
    return ""


def _is_dist(filename: str) -> bool:
    return any(p in filename for p in _DIST_PATHS) and not any(
        p in filename for p in _NOT_COLLECTIVE
    )


def culprits(places: dict[str, Place]) -> tuple[list[str], str]:
    """The processes the job waits for, and why ('' blamed when nobody is)."""
    read = {k: p for k, p in places.items() if p.state != UNREAD}
    inside = {k: p for k, p in read.items() if p.state == COLLECTIVE}
    if len(read) < 2:
        return [], "a single process: nothing to compare it with"
    if not inside:
        return [], "no rank waits in a collective"
    ops = Counter(p.op for p in inside.values())
    if len(ops) > 1:
        said = "; ".join(f"{op}: {_names([k for k in inside if inside[k].op == op])}" for op in ops)
        return [], f"ranks wait in different collectives ({said})"
    op = next(iter(ops))
    behind = [k for k in read if k not in inside]
    if not behind:
        return [], f"every rank is inside {op}"
    verb = "waits" if len(inside) == 1 else "wait"
    return behind, f"not in {op}, which {_names(list(inside))} {verb} in"


def report(processes: Sequence[Process], heading: str) -> tuple[str, list[Process]]:
    """The text report and the blamed processes: the summary, then the stacks of each
    place once (the culprit's first)."""
    processes = sorted(processes, key=_order)
    lines, blamed = summary(processes, heading)
    places = {p.label: place(p) for p in processes}
    for members in sorted(_groups(processes, places), key=lambda m: m[0] not in blamed):
        lines.append(_stacks_block(members))
    return "\n".join(lines), blamed


def summary(processes: Sequence[Process], heading: str) -> tuple[list[str], list[Process]]:
    """The heading, the culprit line and one line per place (ranks grouped)."""
    processes = sorted(processes, key=_order)
    places = {p.label: place(p) for p in processes}
    blamed_labels, why = culprits(places)
    blamed = [p for p in processes if p.label in blamed_labels]
    lines = [heading]
    if blamed:
        first = places[blamed[0].label]
        lines.append(f"culprit: {_names(blamed_labels)} at {first.frame} ({why})")
    else:
        lines.append(f"culprit: none found ({why})")
    groups = _groups(processes, places)
    lines += [_group_line(members, places[members[0].label]) for members in groups]
    return lines, blamed


def agent_summary(
    sessions: Sequence[Mapping[str, Any]], answers: Sequence[str | None], timeout: float
) -> str:
    """``breakpod stacks SESSION|JOB``: the same summary over the agents' own dumps."""
    processes = [
        Process(
            pid=int(s.get("pid") or 0),
            threads=parse(answer or ""),
            rank=s.get("rank"),
            error=None if answer else f"no answer within {timeout:g}s",
            host=str(s.get("pod") or s.get("host") or ""),
        )
        for s, answer in zip(sessions, answers, strict=True)
    ]
    job = sessions[0].get("job") if sessions else None
    what = f"{len(processes)} ranks of job {job}" if job and len(processes) > 1 else "1 process"
    return "\n".join(summary(processes, f"stacks: {what}, from their agents")[0])


def to_json(processes: Sequence[Process]) -> dict[str, Any]:
    processes = sorted(processes, key=_order)
    places = {p.label: place(p) for p in processes}
    blamed, why = culprits(places)
    return {
        "culprit": [_key(p) for p in processes if p.label in blamed],
        "why": why,
        "processes": [
            {
                **{k: v for k, v in asdict(p).items() if k != "threads"},
                **asdict(places[p.label]),
                "threads": [asdict(t) for t in p.threads],
            }
            for p in processes
        ],
    }


def _key(process: Process) -> dict[str, Any]:
    return {"rank": process.rank, "pid": process.pid, "host": process.host}


def _order(process: Process) -> tuple[int, str, int]:
    rank = process.rank if process.rank is not None else 1 << 30
    return rank, process.host, process.pid


def _groups(processes: Sequence[Process], places: dict[str, Place]) -> list[list[Process]]:
    groups: dict[Place, list[Process]] = {}
    for p in processes:
        key = places[p.label] if places[p.label].state != UNREAD else Place(UNREAD, p.label)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def _group_line(members: Sequence[Process], where: Place) -> str:
    names = _names([p.label for p in members])
    if where.state == UNREAD:
        return f"{names}: stacks not read: {members[0].error or 'no Python thread'}"
    if where.state == COLLECTIVE:
        return f"{names}: in collective {where.op}, at {where.frame}"
    if where.state == BACKWARD:
        return f"{names}: in backward, at {where.frame}"
    return f"{names}: in user code, at {where.frame}"


def _stacks_block(members: Sequence[Process]) -> str:
    first = members[0]
    if first.error:
        return f"=== {first.label}: {first.error} ==="
    same = f"; the same place as {_names([p.label for p in members[1:]])}" if members[1:] else ""
    stacks = format_threads(first.threads).rstrip("\n")
    pid = f" (pid {first.pid})" if first.rank is not None else ""
    return f"=== {first.label}{pid}{same} ===\n{stacks}"


def _names(labels: Sequence[str]) -> str:
    """'rank 0', 'ranks 0,2', 'pid 12, pid 14'."""
    ranks = [label.removeprefix("rank ") for label in labels if label.startswith("rank ")]
    if len(ranks) == len(labels) and len(ranks) > 1:
        return "ranks " + ",".join(ranks)
    return ", ".join(labels)
