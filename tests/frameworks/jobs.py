"""Framework jobs as real child processes: one Python process, or ranks under torchrun."""

from __future__ import annotations

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script(name: str) -> str:
    """The source of tests/frameworks/scripts/NAME.py, for the spawn fixture."""
    with open(os.path.join(ROOT, "tests", "frameworks", "scripts", f"{name}.py")) as f:
        return f.read()
