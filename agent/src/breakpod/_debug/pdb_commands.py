"""Extra commands for breakpod's pdb sessions (local and remote).

Commands come from the registry (:mod:`breakpod._debug.registry`, filled from
above); every breakpod pdb looks them up before falling back to pdb's own.

``where`` shows the user's frames; torch's and breakpod's are hidden unless
``where all``. A park can ask to open on a frame that is not the innermost
(:func:`focus`): the optimizer hook's caller rather than the hook.
"""

from __future__ import annotations

import contextlib
import pdb
from collections.abc import Iterator
from types import FrameType
from typing import Any

from breakpod._debug.registry import COMMANDS
from breakpod._debug.registry import command as command  # where the monitors' commands register

LIBRARIES = ("torch", "breakpod")
_FOCUS: list[FrameType] = []


@contextlib.contextmanager
def focus(frame: FrameType) -> Iterator[None]:
    """Sessions started inside this block open on ``frame`` when it is on their stack."""
    _FOCUS.append(frame)
    try:
        yield
    finally:
        _FOCUS.pop()


def is_library(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in LIBRARIES


class CommandsMixin(pdb.Pdb):
    """Dispatches registered commands; errors in them never end the session."""

    def onecmd(self, line: str) -> bool:
        name, _, arg = line.strip().partition(" ")
        fn = COMMANDS.get(name)
        if fn is None:
            return super().onecmd(line)
        self.lastcmd = line
        try:
            return bool(fn(self, arg.strip()))
        except Exception as e:  # a broken command must not end the session
            self.error(f"{name}: {type(e).__name__}: {e}")
        return False

    def setup(self, f: FrameType | None, tb: Any) -> None:
        super().setup(f, tb)
        frames = [frame for frame, _ in self.stack]
        if _FOCUS and _FOCUS[-1] in frames:
            self.curindex = frames.index(_FOCUS[-1])
            self.curframe = self.stack[self.curindex][0]
            self.curframe_locals = self.curframe.f_locals

    def do_where(self, arg: str) -> None:
        """w(here) [all]: the stack, the user's frames only; ``all`` adds torch's and breakpod's."""
        if arg.strip() == "all":
            super().do_where("")
            return None
        hidden = 0
        for i, entry in enumerate(self.stack):
            if is_library(entry[0]) and i != self.curindex:
                hidden += 1
                continue
            self.print_stack_entry(entry)
        if hidden:
            self.message(f"({hidden} torch/breakpod frames hidden; 'where all' shows them)")
        return None

    do_w = do_bt = do_where

    def do_help(self, arg: str) -> bool | None:
        fn = COMMANDS.get(arg.strip())
        if fn is not None:
            self.message((fn.__doc__ or arg).strip())
            return None
        result = super().do_help(arg)
        if not arg and COMMANDS:
            self.message("breakpod commands: " + "  ".join(sorted(COMMANDS)) + "\n")
        return result

    do_h = do_help
