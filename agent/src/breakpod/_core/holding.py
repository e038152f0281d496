"""Whether a debugger holds this process now (parked, or a client attached).

A held process is not a stalled one: the park primitives (remote pdb, the
debugpy wait) report here, and the stall watchdog, a layer above, reads
:func:`is_held` and is told on each release. Holds nest (a counter).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import FrameType

_lock = threading.Lock()
_count = 0
_on_release: list[Callable[[], None]] = []
_stopped_at: FrameType | None = None  # see stopped_at()


def hold() -> None:
    global _count
    with _lock:
        _count += 1


def release() -> None:
    """One hold ends; the callbacks run (outside the lock) so silence counts from now."""
    global _count
    with _lock:
        _count = max(0, _count - 1)
    for callback in list(_on_release):
        callback()


def is_held() -> bool:
    return _count > 0


def on_release(callback: Callable[[], None]) -> None:
    if callback not in _on_release:
        _on_release.append(callback)


@contextlib.contextmanager
def stopped_at(frame: FrameType) -> Iterator[None]:
    """A post-mortem holds the process in the excepthook, whose stack no longer holds the
    frame that raised: while it lasts, that frame is where the process stopped (what its
    peers and the stall report name)."""
    global _stopped_at
    previous, _stopped_at = _stopped_at, frame
    try:
        yield
    finally:
        _stopped_at = previous


def stopped_frame() -> FrameType | None:
    return _stopped_at
