"""``breakpoint()`` that parks instead of dying, post-mortem on crashes, and the other
ways into a debugger: which debugger serves each (the park itself: ``park.py``).

The verbs (each builds the settings once, from the environment, and hands them down):

    set_trace(frame=, header=)   breakpoint(): stop at the caller's next line
    hold(frame, reason)          hold the process now, showing ``frame`` (an anomaly, a
                                 ``break`` inside the optimizer's step)
    inspect(frame, reason)       look at another thread's frame; nothing stops (a stall)
    park_here(frame, ...)        the remote pdb at ``frame`` with given settings
                                 (``init_remote_debugger(wait=True)``)
    post_mortem(tb), install_excepthook()

Routing of :func:`set_trace` (``PYTHONBREAKPOINT=breakpod.set_trace``):

1. a debugpy listener is active -> the attached IDE stops in the caller;
2. stdin is a usable TTY        -> plain local pdb, as ``breakpoint()`` would
                                   (unless ENABLE_REMOTE_DEBUG=1);
3. BREAKPOD_BACKEND=debugpy     -> start the debugpy listener (the policy of
   (``breakpod run --backend``)    ``debugger.start_listener`` applies) and wait
                                   for a DAP client there;
4. otherwise (container, CI)    -> park on the remote pdb socket and wait.

Nothing here may raise into the training code: a failure is announced and
the program continues. What the training code itself raises while a park waits
(a signal handler's "preempted: stop") goes on up, as it would from any line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from collections.abc import Callable
from types import FrameType, TracebackType

from breakpod._core import holding
from breakpod._core.announce import announce
from breakpod._core.config import ENV, Settings
from breakpod._core.errors import AnomalyError
from breakpod._debug import debugger, park, remote_pdb
from breakpod._debug.pdb_commands import CommandsMixin, focus, is_library
from breakpod._debug.registry import load_commands
from breakpod._debug.remote_pdb import SKIP, still_attached

log = logging.getLogger(__name__)

Start = Callable[[], None]


class LocalPdb(CommandsMixin):
    """Terminal pdb with breakpod's extra commands."""

    def __init__(self) -> None:
        super().__init__(skip=SKIP)
        load_commands()


def stdin_is_tty() -> bool:
    stdin = sys.stdin
    try:
        return stdin is not None and not stdin.closed and stdin.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def use_local_pdb(settings: Settings, tty: bool | None = None) -> bool:
    """A TTY gets plain pdb, unless remote debugging was asked for explicitly.

    Debug overlays give containers a TTY (``tty: true``) for ``docker attach``
    and also set ``ENABLE_REMOTE_DEBUG=1``: there nobody watches the TTY, so
    breakpoints must still park on the socket.
    """
    return (stdin_is_tty() if tty is None else tty) and not settings.enabled


def set_trace(
    *_args: object, header: str | None = None, frame: FrameType | None = None, **_kwargs: object
) -> None:
    """Break into a debugger in the caller's frame; never raises into it."""
    frame = frame if frame is not None else sys._getframe(1)
    try:
        start = _prepare(frame, header)
    except Exception as e:  # the training job outlives any breakpod failure
        if raised_elsewhere(e):
            raise
        announce(f"breakpoint() could not start a debugger ({type(e).__name__}: {e}); continuing")
        return
    if start is not None:
        start()  # last: pdb traces from the next line of the caller on


def _prepare(frame: FrameType, header: str | None) -> Start | None:
    reason = header or f"breakpoint() at {where(frame)}"
    settings = settings_from_env()
    if debugger.debugpy_endpoint() is not None:
        return _prepare_debugpy(frame, reason, settings)
    if use_local_pdb(settings):
        return lambda: LocalPdb().set_trace(frame)
    serves = debugpy_serves(settings)
    if serves is None:
        return None
    if serves:
        return _prepare_debugpy(frame, reason, settings)
    attached = still_attached()
    if attached is not None:  # the engineer continued with breakpoints set: theirs
        attached.message(f"breakpod: {reason}")
        return lambda: _trace_again(attached, frame)
    parked = park.open_pdb(settings, reason, settings.hold_seconds)
    if parked is None:
        return None
    return lambda: remote_pdb.trace(parked, frame, quit_mode=settings.quit_mode)


def _trace_again(debugger: CommandsMixin, frame: FrameType) -> None:
    """Stop ``debugger``, which traces this thread already, in ``frame``'s next line."""
    sys.settrace(None)  # else it would stop in its own set_trace, which it would trace
    debugger.set_trace(frame)


def hold(frame: FrameType, header: str) -> bool:
    """Hold the process *now* in a debugger showing ``frame`` (``breakpoint()`` would
    stop only at the caller's next line: after the optimizer applied the update).

    Returns False when nobody attached in time or no debugger could start.
    """
    try:
        settings = settings_from_env()
        serves: bool | None = debugger.debugpy_endpoint() is not None
        if not serves and not use_local_pdb(settings):
            serves = debugpy_serves(settings)
            if serves is None:
                return False
        if serves:
            if park.open_dap(header, settings.hold_seconds) is None:
                return False
            debugger.debugpy_stop_at(frame)  # a DAP client stops at the caller's next line
            return True
        with focus(frame):
            return _hold_in_pdb(settings, header)
    except Exception as e:  # the training job outlives any breakpod failure
        if raised_elsewhere(e):
            raise
        announce(f"{header}: could not start a debugger ({type(e).__name__}: {e}); continuing")
        return False


# Code whose exceptions in a park are breakpod's failures (contained): breakpod's own,
# the standard library's and debugpy's (its vendored pydevd). Anything else is the job's.
_OURS = frozenset(
    {"breakpod", debugger.DEBUGPY_MODULE, "pydevd", "_pydevd_bundle", "_pydev_bundle"}
) | frozenset(sys.stdlib_module_names)


def raised_elsewhere(error: BaseException) -> bool:
    """Did code other than breakpod's, debugpy's and the standard library's raise
    ``error``: a signal handler that ran while a park waited? Then it is the job's to
    handle. Judged by each frame's module, not its file: a job installed into
    site-packages sits under the standard library's folder."""
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in _OURS:
            return True
        tb = tb.tb_next
    return False


def _hold_in_pdb(settings: Settings, reason: str) -> bool:
    here = sys._getframe(2)  # the park's caller: `where all` shows every frame down to it
    if use_local_pdb(settings):
        local = LocalPdb()
        local.reset()
        local.interaction(here, None)
        return True
    parked = park.open_pdb(settings, reason, settings.hold_seconds)
    if parked is None:
        return False
    remote_pdb.inspect(parked, here, quit_mode=settings.quit_mode)
    return True


def park_here(frame: FrameType, settings: Settings, reason: str, *, hold_seconds: float) -> bool:
    """Park in a remote pdb at ``frame`` now; False when nobody attached in time."""
    parked = park.open_pdb(settings, reason, hold_seconds)
    if parked is None:
        return False
    remote_pdb.trace(parked, frame, quit_mode=settings.quit_mode)
    return True


def inspect(frame: FrameType, reason: str) -> None:
    """Show ``frame`` (another thread's: a stalled main thread) in a remote pdb; nothing
    stops, and ``q`` detaches whatever the settings say."""
    settings = settings_from_env()
    parked = park.open_pdb(settings, reason, settings.hold_seconds)
    if parked is not None:
        remote_pdb.inspect(parked, frame, quit_mode="detach")


def debugpy_serves(settings: Settings) -> bool | None:
    """Does a debugpy listener serve a park? True when one runs, or when the settings
    ask for debugpy (``BREAKPOD_BACKEND=debugpy``) and it starts now; False: the
    remote pdb does (also when debugpy is asked for but not installed, said once
    per park); None: debugpy was asked for and may not start (said): nothing parks,
    never a listener the settings did not ask for."""
    if debugger.debugpy_endpoint() is not None:
        return True
    if settings.backend != debugger.DAP:
        return False
    if importlib.util.find_spec(debugger.DEBUGPY_MODULE) is None:
        announce(
            f"{ENV['backend']}=debugpy, but debugpy is not installed "
            "(pip install 'breakpod[debugpy]'): the remote pdb serves this park"
        )
        return False
    asked = dataclasses.replace(settings, enabled=True)  # a park asks for a listener
    return debugger.start_listener(asked, [], set_trace) is not None or None


def _prepare_debugpy(frame: FrameType, reason: str, settings: Settings) -> Start | None:
    if park.open_dap(reason, settings.hold_seconds) is None:
        return None
    return lambda: debugger.debugpy_stop_at(frame)


def post_mortem(
    tb: TracebackType | BaseException | None = None,
    *,
    reason: str | None = None,
    hold_seconds: float | None = None,
    then: str = "continuing",
) -> None:
    """Inspect a traceback (or an exception's): the DAP client when a debugpy listener
    runs, local pdb on a TTY (see :func:`use_local_pdb`), else a remote pdb session
    held open up to ``hold_seconds``."""
    exc, tb = _exc_and_tb(tb)
    if tb is None:
        raise ValueError("post_mortem() needs a traceback, or must run inside an except block")
    settings = settings_from_env()
    hold = settings.hold_seconds if hold_seconds is None else hold_seconds
    tb = user_traceback(tb)
    raised_in = innermost(tb).tb_frame
    reason = reason or f"post-mortem at {where(raised_in)}"
    with holding.stopped_at(raised_in):
        if debugger.debugpy_endpoint() is not None:
            _post_mortem_debugpy(exc, tb, reason, hold)
        elif use_local_pdb(settings):
            local = LocalPdb()
            local.reset()
            local.interaction(None, tb)
        else:
            parked = park.open_pdb(settings, reason, hold, then)
            if parked is not None:
                remote_pdb.post_mortem(parked, tb, quit_mode=settings.quit_mode)


def _exc_and_tb(
    given: TracebackType | BaseException | None,
) -> tuple[BaseException | None, TracebackType | None]:
    if isinstance(given, BaseException):
        return given, given.__traceback__
    current = sys.exc_info()[1]
    if current is not None and given in (None, current.__traceback__):
        return current, current.__traceback__
    return None, given


def _post_mortem_debugpy(
    exc: BaseException | None, tb: TracebackType, reason: str, hold: float
) -> None:
    """Show ``tb`` to a DAP client (as an unhandled exception), waiting up to ``hold``."""
    parked = park.open_dap(reason, hold)
    if parked is not None:
        debugger.debugpy_post_mortem(exc, tb)
        parked.detached("post-mortem session over", waits_again=False)


def install_excepthook() -> None:
    """On an uncaught exception, open a post-mortem session before exiting.

    The traceback is printed as usual first; afterwards the process exits
    with the status it would have had. Idempotent.
    """
    if getattr(sys.excepthook, "__breakpod__", False):
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        if tb is None or issubclass(exc_type, KeyboardInterrupt):
            return
        if _told_to_stop(exc):
            announce(f"uncaught {exc_type.__name__}: the process was told to stop; no post-mortem")
            return
        if _already_held(exc):
            announce("the anomaly was already held in a debugger; exiting with status 1")
            return
        try:
            reason = (
                f"uncaught {exc_type.__name__} at {where(innermost(user_traceback(tb)).tb_frame)}"
            )
            then = "exiting with status 1"
            post_mortem(exc if exc.__traceback__ is tb else tb, reason=reason, then=then)
        except Exception as e:
            announce(f"post-mortem failed ({type(e).__name__}: {e})")

    hook.__breakpod__ = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _told_to_stop(exc: BaseException) -> bool:
    """An exception a signal handler raised to stop the process (torchrun's agent raises
    SignalException on SIGTERM, as a pod's deletion sends): a request to stop, which a
    park would hold up to the hold time, not a crash."""
    return type(exc).__name__ == "SignalException" and hasattr(exc, "sigval")


def _already_held(exc: BaseException) -> bool:
    """A ``[break, stop]`` anomaly: its break was the one hold; no second post-mortem."""
    return isinstance(exc, AnomalyError) and bool(getattr(exc.anomaly, "held", False))


def user_traceback(tb: TracebackType) -> TracebackType:
    """``tb`` cut after its innermost user frame (not torch's or breakpod's), when it has one.

    Post-mortem opens on the last entry: the user's ``nll_loss(...)`` line, not
    torch's ``functional.py``.
    """
    entries = []
    node: TracebackType | None = tb
    while node is not None:
        entries.append(node)
        node = node.tb_next
    users = [i for i, e in enumerate(entries) if not is_library(e.tb_frame)]
    if not users or users[-1] == len(entries) - 1:
        return tb
    cut: TracebackType | None = None
    for e in reversed(entries[: users[-1] + 1]):
        cut = TracebackType(cut, e.tb_frame, e.tb_lasti, e.tb_lineno)
    assert cut is not None
    return cut


def where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}()"


def innermost(tb: TracebackType) -> TracebackType:
    """The traceback entry where the exception was raised."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def settings_from_env() -> Settings:
    """Environment settings; each bad value is announced on its own line. A bad
    ordinary value falls back alone; a bad security value leaves
    ``Settings.refused`` set, so no listener starts (never the defaults instead)."""
    settings, problems = Settings.load()
    for line in problems:
        announce(line)
    return settings
