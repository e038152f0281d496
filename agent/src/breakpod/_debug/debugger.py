"""The process's listeners: a remote pdb socket and/or a debugpy (DAP) listener.

State is process-wide and created on first use, so calling
``init_remote_debugger()`` twice, or ``breakpoint()`` after it, reuses the
same port. Nothing here runs, imports debugpy or binds anything until asked.
Parking is a layer above (``park``, ``breakpoints``); :func:`start_listener` takes the
``breakpoint()`` hook it installs beside debugpy as an argument.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NamedTuple

from breakpod import protocol
from breakpod._core import events, net, threads, wiring
from breakpod._core.announce import announce
from breakpod._core.config import BACKENDS, ENV, Settings
from breakpod._core.errors import BreakpodError, ConfigError
from breakpod._debug.listener import Listener

log = logging.getLogger(__name__)
PDB = protocol.DEFAULT_LISTENER
DAP = protocol.DAP_LISTENER
DEBUGPY_MODULE = DAP  # the listener is named after the package that provides it


class Endpoint(NamedTuple):  # not a dataclass: a fifth of its cost on a cold breakpoint()
    """Where a listener accepts clients."""

    backend: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return net.format_address(self.host, self.port)


class _State:
    lock = threading.RLock()
    pdb: Listener | None = None
    debugpy: Endpoint | None = None
    debugpy_wait_ended: threading.Event | None = None  # present while wait_for_client() runs

    ide_follows_fork = False  # a DAP client was attached when the process forked

    @classmethod
    def note_fork(cls) -> None:
        if cls.debugpy is not None:
            cls.ide_follows_fork = bool(sys.modules[DEBUGPY_MODULE].is_client_connected())

    @classmethod
    def forget_parent_listener(cls) -> None:
        """In a forked child (a DataLoader worker) the acceptor thread is gone. The
        debugpy listener serves the parent: an attached IDE is offered the child (as
        a subprocess to attach to), but without one nobody could reach the child
        there, so it parks on a pdb listener of its own."""
        if cls.pdb is not None:
            cls.pdb.close()
        cls.pdb = None
        if not cls.ide_follows_fork:
            cls.debugpy = None
        cls.debugpy_wait_ended = None
        cls.lock = threading.RLock()


os.register_at_fork(before=_State.note_fork, after_in_child=_State.forget_parent_listener)


def pdb_listener(settings: Settings, *, checked: bool = False) -> Listener:
    """The process's remote pdb listener, bound on first use; refused (ConfigError,
    InsecureBindError) when a security setting is bad or missing, unless the caller
    ``checked`` them already (:func:`start_listener` does, once)."""
    with _State.lock:
        if _State.pdb is None:
            if not checked:
                check_bind(settings, PDB)
            _State.pdb = Listener(
                settings.host,
                settings.listen_port,
                token=settings.token,
                require_token=settings.require_token,
                attach_idle=settings.attach_idle,
            )
        return _State.pdb


def check_bind(settings: Settings, backend: str) -> None:
    """May ``backend`` listen where ``settings`` ask? Raises why not (the one check)."""
    if settings.refused:
        raise ConfigError(settings.refused)
    net.check_bind(
        settings.host, backend=backend, token=settings.token, allow_insecure=settings.allow_insecure
    )


def active_pdb_listener() -> Listener | None:
    """The remote pdb listener, if one was started (the broker's commands act on it)."""
    return _State.pdb


def debugpy_endpoint() -> Endpoint | None:
    """The active debugpy listener, if :func:`init_remote_debugger` started one."""
    return _State.debugpy


BreakpointHook = Callable[..., None]


def start_listener(
    settings: Settings, fallbacks: list[str], breakpoint_hook: BreakpointHook
) -> Endpoint | None:
    """Start the listener ``settings`` ask for (``init_remote_debugger()`` does the
    waiting); ``None`` when disabled or when it could not start (announced)."""
    if not settings.enabled:
        return None
    for line in fallbacks:
        announce(line)
    if settings.refused:  # the job goes on without a listener, never with an open one
        announce(settings.refused)
        return None
    wiring.connect()  # reports to the broker when BREAKPOD_BROKER_URL is set
    chosen = choose_backend(settings.backend)
    if chosen == DAP and token_policy(settings):  # never falls back: no listener starts
        announce(DEBUGPY_HAS_NO_TOKEN)
        return None
    check_bind(settings, chosen)
    try:
        if chosen == DAP:
            return _start_debugpy(settings, breakpoint_hook)
        return _start_pdb(settings)
    except (BreakpodError, OSError, RuntimeError) as e:
        announce(f"could not start the {chosen} listener: {e}")
        return None


DEBUGPY_HAS_NO_TOKEN = (
    f"{ENV['require_token']}=1 (or {ENV['token']} on a non-loopback bind) asks every "
    "client for the token, and debugpy cannot check one (DAP has no authentication): "
    f"set {ENV['backend']}=pdb for a listener that does; no debugger listener in this process"
)


def token_policy(settings: Settings) -> bool:
    """Would the remote pdb listener ask for the token? Then debugpy may not listen."""
    return settings.require_token or bool(settings.token and not net.is_loopback(settings.host))


def choose_backend(requested: str) -> str:
    if requested not in BACKENDS:
        raise ConfigError(f"backend={requested!r} is not one of: {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    chosen = DAP if importlib.util.find_spec(DEBUGPY_MODULE) else PDB
    log.info("backend auto: using %s", chosen)
    return chosen


def _start_pdb(settings: Settings) -> Endpoint:
    listener = pdb_listener(settings, checked=True)
    endpoint = Endpoint(PDB, listener.host, listener.port)
    announce(
        f"remote pdb ready on {endpoint.address}: breakpoint() and crashes park here; "
        f"attach with: breakpod attach {endpoint.address}"
    )
    return endpoint


def _start_debugpy(settings: Settings, breakpoint_hook: BreakpointHook) -> Endpoint:
    with _State.lock:
        if _State.debugpy is not None:
            return _State.debugpy
        os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # frozen-modules noise
        import debugpy

        if not net.is_loopback(settings.host):
            announce(
                f"WARNING: debugpy listens on {settings.host} with no authentication: "
                "anyone who reaches this port can run code in this process"
            )
        host, port = debugpy.listen((settings.host, settings.listen_port))
        _State.debugpy = Endpoint(DAP, host, port)
        # debugpy installs a breakpointhook that ignores breakpoint() until an IDE is
        # attached; ours waits for one (up to the hold time), like the pdb path.
        sys.breakpointhook = breakpoint_hook
    address = _State.debugpy.address
    announce(
        f"debugpy listening on {address}: attach VS Code or any DAP client "
        f"(breakpod attach --vscode {address} prints a launch.json)"
    )
    events.emit(protocol.LISTENING, backend=DAP, address=address)
    return _State.debugpy


def wait_for_debugpy_client(timeout: float) -> bool:
    """Block until a DAP client attaches or ``timeout`` seconds pass."""
    import debugpy

    if debugpy.is_client_connected():
        return True
    if timeout <= 0:
        return False
    ended = _State.debugpy_wait_ended = threading.Event()
    if timeout != float("inf"):
        _end_debugpy_wait_soon(ended, after=timeout)
    try:
        debugpy.wait_for_client()
    finally:
        ended.set()
        _State.debugpy_wait_ended = None
    time.sleep(0)  # let pydevd settle its attach state
    return bool(debugpy.is_client_connected())


def _end_debugpy_wait_soon(ended: threading.Event, after: float = 0.0) -> None:
    def cancel_until_ended() -> None:
        import debugpy

        if ended.wait(after):
            return
        # cancel() raises until wait_for_client() has begun (a loaded machine, a short
        # hold): one try could come too early and leave the job waiting for ever
        while not ended.is_set():
            with contextlib.suppress(RuntimeError):
                debugpy.wait_for_client.cancel()
            ended.wait(0.02)

    threads.start_daemon(cancel_until_ended, "breakpod-debugpy-wait")


def debugpy_post_mortem(exc: BaseException | None, tb: TracebackType) -> None:
    """Stop the attached DAP client at the innermost frame of ``tb`` until it continues."""
    import debugpy

    trigger = getattr(debugpy, "trigger_exception_handler", None)
    if trigger is None:  # debugpy < 1.8.21 has no post-mortem entry point
        announce(f"debugpy {debugpy.__version__} cannot show a post-mortem; use the pdb backend")
        return
    exc = exc if exc is not None else RuntimeError("post-mortem")  # a bare traceback
    trigger((type(exc), exc, tb), as_uncaught=False)


def cancel_debugpy_wait() -> bool:
    """End a wait for a DAP client (a broker ``resume``); False when none waits."""
    ended = _State.debugpy_wait_ended
    if _State.debugpy is None or ended is None:
        return False
    _end_debugpy_wait_soon(ended)
    return True


def debugpy_stop_at(frame: FrameType) -> None:
    """Suspend this thread in ``frame`` for the attached DAP client."""
    import debugpy.server.api  # noqa: F401  (puts the vendored pydevd on sys.path)
    import pydevd

    kwargs: dict[str, Any] = {
        "suspend": True,
        "trace_only_current_thread": True,
        "patch_multiprocessing": False,
        "stop_at_frame": frame,
        "notify_stdin": False,
    }
    pydevd.settrace(**kwargs)
