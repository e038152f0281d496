"""``%load_ext breakpod``: the ``%breakpod`` line magic for notebooks.

    %breakpod sessions            the broker's sessions (BREAKPOD_BROKER_URL)
    %breakpod watch model         monitors on the notebook's ``model``; anomalies as rich output
    %breakpod attach SESSION      a remote pdb in the cell's output (input() through the kernel)
    %breakpod debug               post-mortem of the last exception (parks; attach from a shell)

Loading imports neither torch nor IPython's display machinery until a command
needs it.
"""

from __future__ import annotations

import contextlib
import html
import importlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

USAGE = "usage: %breakpod sessions | watch NAME | attach SESSION|HOST:PORT | debug"


def load(ipython: Any) -> None:
    ipython.register_magic_function(_magic(ipython), "line", "breakpod")


def _magic(ipython: Any) -> Any:
    def breakpod(line: str) -> Any:
        command, *args = line.split() or [""]
        handler = COMMANDS.get(command)
        if handler is None:
            print(USAGE, file=sys.stderr)
            return None
        return handler(ipython, args)

    return breakpod


def _cli(argv: list[str]) -> None:
    from breakpod._cli.main import main

    with contextlib.suppress(SystemExit):  # argparse said what was wrong; a cell goes on
        main(argv)


def sessions(ipython: Any, args: list[str]) -> None:
    _cli(["sessions", *args])


def attach(ipython: Any, args: list[str]) -> None:
    if len(args) != 1:
        print("usage: %breakpod attach SESSION|HOST:PORT", file=sys.stderr)
        return
    _cli(["attach", args[0]])


def watch(ipython: Any, args: list[str]) -> Any:
    """Watch ``user_ns[NAME]``; each anomaly shows as an HTML block in the cell that found it."""
    if len(args) != 1 or args[0] not in ipython.user_ns:
        print(
            f"%breakpod watch NAME: NAME must be a model in the notebook; {USAGE}", file=sys.stderr
        )
        return None
    from breakpod._monitor.monitor import watch as watch_model

    return watch_model(ipython.user_ns[args[0]], sink=show_anomaly)


def show_anomaly(anomaly: Any) -> None:
    shown: Any = importlib.import_module("IPython.display")  # present: a kernel runs us
    text = html.escape(str(anomaly))
    shown.display(
        shown.HTML(f'<div class="breakpod-anomaly" style="color:#b00"><b>breakpod</b> {text}</div>')
    )


def debug(ipython: Any, args: list[str]) -> None:
    """Post-mortem of the last cell's exception: parks like a crashed job would."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        print("%breakpod debug: no exception yet (run it after a cell failed)", file=sys.stderr)
        return
    from breakpod._debug.breakpoints import post_mortem

    with _announcements_in_cell():
        post_mortem(tb)


@contextlib.contextmanager
def _announcements_in_cell() -> Iterator[None]:
    """breakpod's lines (where to attach) go to the process's real stderr, the kernel's
    log: show them in the cell too while a command runs."""
    logger = logging.getLogger("breakpod")
    handler = logging.StreamHandler(sys.stderr)  # the kernel's: the cell's output
    handler.setFormatter(logging.Formatter("breakpod: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


COMMANDS = {"sessions": sessions, "watch": watch, "attach": attach, "debug": debug}
