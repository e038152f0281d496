"""Messages a user must see (where to attach) reach the real stderr."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("breakpod")


def rank_label() -> str:
    """``[rank N] `` in a job of several ranks (torchrun's RANK, WORLD_SIZE), else ``""``."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(world) > 1:
        return f"[rank {rank}] "
    return ""


_LABEL = rank_label()  # the launcher sets these before the process starts


def announce(message: str) -> None:
    """One line on the process's real stderr (stdout may be redirected)."""
    log.info(message)
    stream = sys.__stderr__
    if stream is None:
        return
    try:
        stream.write(f"breakpod: {_LABEL}{message}\n")
        stream.flush()
    except (OSError, ValueError):
        pass
