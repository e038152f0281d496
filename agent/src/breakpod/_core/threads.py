"""The agent's own threads, started so that the job's signals never land on them.

A signal sent to a process (``kill``, torchrun's SIGTERM, a terminal's Ctrl-C) is
delivered to one of its threads that does not block it: Linux prefers the main
thread, but not while that one blocks it or has another signal pending. Python runs
its handlers in the main thread, but a main thread in a long C call (``time.sleep``,
a lock, a queue's ``get``) is woken only by a signal that lands on it: one that
lands on an agent's thread waits for that call to end. So the agent's threads
block the signals a job handles. A thread starts with the mask of
the thread that starts it: the signals are blocked around ``start()`` only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

JOB_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
    if hasattr(signal, name)
)


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A daemon thread running ``target(*args)``, started with the job's signals blocked."""
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    start(thread)
    return thread


def start(thread: threading.Thread) -> None:
    """``thread.start()``, the new thread blocking the job's signals."""
    with _blocked():
        thread.start()


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no per-thread masks
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        yield
    finally:  # a signal that came meanwhile is delivered now, to this thread
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
