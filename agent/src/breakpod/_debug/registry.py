"""The pdb commands registry: what breakpod's pdb sessions add to pdb's own commands.

The debugger owns it; the layers above fill it and it imports none of them. A
command registers with :func:`command`; a layer whose commands may load only when
a session starts collects them in a :class:`CommandSet` and offers a loader with
:func:`add_loader`, which runs as each session begins and registers the set (the
package's face offers the monitors' tensor commands, once torch is loaded).
Light on purpose: ``import breakpod`` loads it, and no pdb.

A command receives the debugger (for ``message``/``error`` and ``curframe``)
and the rest of the line; it returns True to leave the prompt (as ``continue``
does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)
if TYPE_CHECKING:
    import pdb
    from typing import Any

    Command = Callable[[pdb.Pdb, str], Any]

COMMANDS: dict[str, Command] = {}
_LOADERS: list[Callable[[], None]] = []


def command(name: str) -> Callable[[Command], Command]:
    """Register ``fn`` as the pdb command ``name``; its docstring is its help."""

    def register(fn: Command) -> Command:
        COMMANDS[name] = fn
        return fn

    return register


class CommandSet:
    """Commands defined in a layer above, put in the registry by :meth:`register`."""

    def __init__(self) -> None:
        self.commands: dict[str, Command] = {}

    def command(self, name: str) -> Callable[[Command], Command]:
        """As :func:`command`, into this set."""

        def collect(fn: Command) -> Command:
            self.commands[name] = fn
            return fn

        return collect

    def register(self) -> None:
        COMMANDS.update(self.commands)


def add_loader(load: Callable[[], None]) -> None:
    """Run ``load()`` as each session starts; it registers its commands (idempotent)."""
    if load not in _LOADERS:
        _LOADERS.append(load)


def load_commands() -> None:
    """Before a session: the loaders offered from above (one that cannot load is skipped)."""
    for load in list(_LOADERS):
        with contextlib.suppress(ImportError):
            load()
