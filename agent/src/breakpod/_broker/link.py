"""This process's link to the broker: the emitter ships the hub's events, and
:mod:`breakpod._broker.commands` answers the commands the broker sends back.

The layers below ask for it through :func:`breakpod._core.wiring.connect`; the
package's face installs :func:`connect` there, so none of them imports this.
"""

from __future__ import annotations

from breakpod._broker import commands as broker_commands
from breakpod._broker import emitter


def connect() -> emitter.Emitter | None:
    """Start reporting (idempotent); ``None`` when no broker is configured."""
    return emitter.start_once(on_command=broker_commands.run)
