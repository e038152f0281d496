"""Extra commands for breakpod's pdb sessions (local and remote).

Other parts of breakpod register commands here (the tensor commands
``tstat``, ``tshape``, ``tgrad``, ``tmem``, ``tnan`` come from the monitors);
every breakpod pdb looks them up before falling back to pdb's own.
A command receives the debugger (for ``message``/``error`` and
``curframe``) and the rest of the line.
"""

from __future__ import annotations

import contextlib
import importlib
import pdb
import sys
from collections.abc import Callable

Command = Callable[[pdb.Pdb, str], None]

COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Command], Command]:
    """Register ``fn`` as the pdb command ``name``; its docstring is its help."""

    def register(fn: Command) -> Command:
        COMMANDS[name] = fn
        return fn

    return register


def load_builtin_commands() -> None:
    """Import the tensor commands when torch is already loaded (never load it)."""
    if "torch" not in sys.modules:
        return
    with contextlib.suppress(ImportError):
        importlib.import_module("breakpod.tensor_commands")


class CommandsMixin(pdb.Pdb):
    """Dispatches registered commands; errors in them never end the session."""

    def onecmd(self, line: str) -> bool:
        name, _, arg = line.strip().partition(" ")
        fn = COMMANDS.get(name)
        if fn is None:
            return super().onecmd(line)
        self.lastcmd = line
        try:
            fn(self, arg.strip())
        except Exception as e:  # a broken command must not end the session
            self.error(f"{name}: {type(e).__name__}: {e}")
        return False

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
