"""Every thread's stack as one text format, whoever read it.

The agent reads its own threads (``sys._current_frames``); ``breakpod stacks --pid``
reads a process with no breakpod inside through py-spy. Both print the blocks
below, so one reader (:func:`parse`) turns either back into threads for the job
report. The user's threads come first; breakpod's own threads (the watchdog, the
broker link, the thread answering the dump) are folded into one last line.

    Thread "MainThread" (tid 4242):
      File "train.py", line 12, in fetch_batch
        time.sleep(60)
      native c10d::Reducer::finalize_backward (libtorch_cpu.so)
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

OWN_PREFIX = "breakpod"  # every thread breakpod starts is named so
_LIBRARY_MARKS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen")
_THREAD = re.compile(r'^Thread "(?P<name>.*)"(?: \(tid (?P<tid>\d+)\))?:$')
_FILE = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<function>.*)$')
_NATIVE = re.compile(r"^  native (?P<function>.*) \((?P<file>[^:]*)(?::(?P<line>\d+))?\)$")
_FOLDED = re.compile(r"^\(breakpod's own threads, folded: (?P<names>.*)\)$")


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str
    line: int
    native: bool = False

    @property
    def library(self) -> bool:
        """Code of the stdlib or of an installed package (torch, breakpod): not the user's."""
        return self.native or any(mark in self.filename for mark in _LIBRARY_MARKS)

    @property
    def where(self) -> str:
        name = self.filename.rsplit("/", 1)[-1]
        return f"{name}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Thread:
    name: str
    frames: tuple[Frame, ...]  # outermost first, as a traceback reads
    tid: int | None = None

    @property
    def own(self) -> bool:
        return self.name.startswith(OWN_PREFIX)

    def user_frame(self) -> Frame | None:
        """The innermost frame of user code, else the innermost Python frame."""
        python = [f for f in self.frames if not f.native]
        users = [f for f in python if not f.library]
        return (users or python)[-1] if python else None


def format_threads(threads: Iterable[Thread]) -> str:
    """The user's threads first (the main thread leading), breakpod's folded last."""
    threads = list(threads)
    users = sorted((t for t in threads if not t.own), key=lambda t: t.name != "MainThread")
    own = [t.name for t in threads if t.own]
    blocks = [_block(t) for t in users]
    if own:
        blocks.append(f"(breakpod's own threads, folded: {', '.join(own)})\n")
    return "\n".join(blocks)


def _block(thread: Thread) -> str:
    tid = "" if thread.tid is None else f" (tid {thread.tid})"
    lines = [f'Thread "{thread.name}"{tid}:']
    for f in thread.frames:
        if f.native:
            at = f":{f.line}" if f.line else ""  # py-spy knows a library, rarely a line
            lines.append(f"  native {f.function} ({f.filename.rsplit('/', 1)[-1]}{at})")
            continue
        lines.append(f'  File "{f.filename}", line {f.line}, in {f.function}')
        source = linecache.getline(f.filename, f.line).strip()
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines) + "\n"


def parse(text: str) -> list[Thread]:
    """The threads of a text :func:`format_threads` wrote (source lines skipped)."""
    threads: list[Thread] = []
    name, tid, frames = None, None, []  # type: tuple[str | None, int | None, list[Frame]]
    for line in text.splitlines():
        head, own = _THREAD.match(line), _FOLDED.match(line)
        if head or own:
            if name is not None:
                threads.append(Thread(name, tuple(frames), tid))
            name, frames = None, []
        if head:
            name, tid = head["name"], int(head["tid"]) if head["tid"] else None
        elif own:
            threads += [Thread(n, ()) for n in own["names"].split(", ")]
        elif name is not None and (m := _FILE.match(line) or _NATIVE.match(line)):
            native = line.startswith("  native ")
            frames.append(Frame(m["function"], m["file"], int(m["line"] or 0), native))
    if name is not None:
        threads.append(Thread(name, tuple(frames), tid))
    return threads


def current(skip: Sequence[str] = ()) -> list[Thread]:
    """This process's threads, read in place (the agent's own dump)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    native_ids = {t.ident: t.native_id for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name not in skip:
            threads.append(Thread(name, _frames_of(frame), native_ids.get(ident)))
    return threads


def _frames_of(frame: FrameType | None) -> tuple[Frame, ...]:
    frames = []
    while frame is not None:
        frames.append(Frame(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(reversed(frames))


def from_pyspy(dump: Sequence[Mapping[str, Any]]) -> list[Thread]:
    """py-spy's ``dump --json`` (frames innermost first) as threads."""
    return [
        Thread(
            _pyspy_name(t),
            tuple(_pyspy_frame(f) for f in reversed(t.get("frames") or [])),
            t.get("os_thread_id"),
        )
        for t in dump
    ]


def _pyspy_name(thread: Mapping[str, Any]) -> str:
    """py-spy names threads from the threading module, if the program imported it; the
    thread whose id is the process's is the main thread either way."""
    if thread.get("thread_name"):
        return str(thread["thread_name"])
    main = thread.get("os_thread_id") is not None and thread.get("os_thread_id") == thread.get(
        "pid"
    )
    return "MainThread" if main else str(thread.get("thread_id"))


def _pyspy_frame(frame: Mapping[str, Any]) -> Frame:
    filename = str(frame.get("filename") or "?")
    native = frame.get("module") is not None  # py-spy names a library for native frames only
    return Frame(str(frame.get("name") or "?"), filename, int(frame.get("line") or 0), native)
