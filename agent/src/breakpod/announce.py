"""Messages a user must see (where to attach) reach the real stderr."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("breakpod")


def announce(message: str) -> None:
    """One line on the process's real stderr (stdout may be redirected)."""
    log.info(message)
    stream = sys.__stderr__
    if stream is None:
        return
    try:
        stream.write(f"breakpod: {message}\n")
        stream.flush()
    except (OSError, ValueError):
        pass
