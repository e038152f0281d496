"""pytest plugin: hold a failed test open for a remote debugger (``pytest --breakpod``).

Inactive unless ``--breakpod`` is given or ``BREAKPOD_CI`` is true; then, on a
test failure or error, a post-mortem session opens at the failing frame (remote
pdb, or debugpy with ``--breakpod-backend debugpy``), the attach instructions
are printed, and the run waits up to the hold time (600 s in CI, 0 locally).
After a detach or the hold time the run goes on; the exit status is pytest's.

Holding stops for the rest of the run after ``--breakpod-first``'s first hold,
and after any hold nobody attached to (nobody is watching this run), so a run
with many failures is delayed by one hold time at most when unattended.
"""

from __future__ import annotations

import bdb
import contextlib
import functools
import os
import re
import sys
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pytest

from breakpod import protocol
from breakpod._core import config, hosting, notice
from breakpod._core.announce import announce
from breakpod._core.config import (
    DEFAULT_PORT,
    ENV,
    Settings,
    format_seconds,
    parse_bool,
    parse_port,
    parse_seconds,
)
from breakpod._core.errors import BreakpodError, ListenerError

if TYPE_CHECKING:  # the debugger modules load only when a failure is held
    from breakpod._core import events
    from breakpod._debug import debugger

HOLD_IN_CI = 600.0
BACKENDS = tuple(b for b in config.BACKENDS if b != "auto")  # auto would pick for you


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("breakpod", "hold a failed test open for a remote debugger")
    group.addoption(
        "--breakpod",
        action="store_true",
        help="on a failure, open a remote post-mortem and wait for a debugger "
        "(also enabled by BREAKPOD_CI=1)",
    )
    group.addoption(
        "--breakpod-hold",
        metavar="SECONDS",
        help="how long to wait for a debugger per failure "
        "(default: $BREAKPOD_HOLD_SECONDS, else 600 in CI and 0 locally; 'forever' allowed)",
    )
    group.addoption(
        "--breakpod-first", action="store_true", help="hold only the first failure of the run"
    )
    group.addoption(
        "--breakpod-backend",
        choices=BACKENDS,
        help="remote pdb (plain text, nc works) or debugpy (VS Code); default pdb",
    )
    group.addoption(
        "--breakpod-port",
        metavar="PORT",
        help="listener port (default $BREAKPOD_PORT or 5678); xdist worker gwN adds N",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not _wanted(config):
        return
    if config.getoption("usepdb", False):
        announce("--pdb is active, so the breakpod plugin stays out of the way")
        return
    try:
        hold = FailureHold(config)
    except BreakpodError as e:
        raise pytest.UsageError(f"breakpod: {e}") from e
    config.pluginmanager.register(hold, "breakpod-hold")


def _wanted(config: pytest.Config) -> bool:
    if config.getoption("breakpod", False):
        return True
    try:
        return parse_bool("BREAKPOD_CI", os.environ.get("BREAKPOD_CI", ""))
    except BreakpodError as e:
        raise pytest.UsageError(f"breakpod: {e}") from e


class FailureHold:
    """Registered only when active, so an inactive plugin adds no hooks at all."""

    def __init__(self, config: pytest.Config) -> None:
        self.where = hosting.detect()
        self.hold = _hold_seconds(config.getoption("breakpod_hold"), self.where)
        self.first = bool(config.getoption("breakpod_first"))
        self.backend = config.getoption("breakpod_backend") or _env_backend()
        self.worker = _worker_index()
        port = _port(config.getoption("breakpod_port"), self.worker)
        self.settings = Settings.from_env(port=port)
        self.done = False
        self._saved_hook: Any = None  # sys.breakpointhook before the session's

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Without a terminal, pytest's own pdb quits at ``breakpoint()`` (BdbQuit: the
        test fails, nothing parks): a ``breakpoint()`` in a test parks as in a job.
        (After pytest's debugging plugin has set its hook; PYTHONBREAKPOINT wins.)"""
        from breakpod._debug import breakpoints

        if os.environ.get("PYTHONBREAKPOINT") or breakpoints.use_local_pdb(self.settings):
            return
        capman = session.config.pluginmanager.getplugin("capturemanager")
        self._saved_hook = sys.breakpointhook
        sys.breakpointhook = functools.partial(_park_uncaptured, capman)

    def pytest_unconfigure(self) -> None:
        if self._saved_hook is not None:
            sys.breakpointhook = self._saved_hook

    def pytest_report_header(self) -> str:
        if self.hold <= 0:
            return "breakpod: failures are not held (hold 0 outside CI; --breakpod-hold SECONDS)"
        port = self.settings.listen_port or "any free port"
        hold = format_seconds(self.hold)
        return f"breakpod: failures are held {hold} for a {self.backend} debugger (port {port})"

    @pytest.hookimpl(trylast=True)
    def pytest_exception_interact(
        self, node: pytest.Item | pytest.Collector, call: pytest.CallInfo[Any]
    ) -> None:
        if self.done or self.hold <= 0 or call.excinfo is None:
            return
        capman = node.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)  # resumed by pytest's next phase
        reporter = node.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()  # "::error" must start a line
        attached = False
        try:
            attached = self._hold(node.nodeid, _original(call.excinfo.value))
        except bdb.BdbQuit:
            pytest.exit("breakpod: the debugger quit the run (BREAKPOD_QUIT=exit)")
        except Exception as e:  # a broken hold must never break the test run
            announce(f"could not hold {node.nodeid} for a debugger ({type(e).__name__}: {e})")
        self.done = self.first or not attached

    def _hold(self, test: str, exc: BaseException) -> bool:
        from breakpod._debug import breakpoints

        tb = _failing_traceback(exc.__traceback__)
        endpoint = self._listen()
        failure = self._failure(test, exc, tb, endpoint)
        local = endpoint.backend == protocol.DEFAULT_LISTENER and breakpoints.use_local_pdb(
            self.settings
        )
        if not local:  # a terminal gets pdb right there, as with --pdb
            notice.show(failure, self.where)
        self._emit(failure)
        with _watch_attach() as attached, _traceback_swapped(exc, tb):
            breakpoints.post_mortem(exc, reason=f"{test} failed", hold_seconds=self.hold)
        return attached.is_set() or local

    def _failure(
        self, test: str, exc: BaseException, tb: TracebackType | None, at: debugger.Endpoint
    ) -> notice.Failure:
        from breakpod._debug import breakpoints

        last = breakpoints.innermost(tb) if tb is not None else None
        return notice.Failure(
            test=test,
            error=_one_line(exc),
            file=last.tb_frame.f_code.co_filename if last else "?",
            line=last.tb_lineno if last else 0,
            backend=at.backend,
            host=at.host,
            port=at.port,
            hold_seconds=self.hold,
        )

    def _listen(self) -> debugger.Endpoint:
        from breakpod import _api as api
        from breakpod._debug import debugger

        if self.backend == protocol.DAP_LISTENER:
            endpoint = api.init_remote_debugger(
                port=self.settings.port, backend=protocol.DAP_LISTENER, enable=True
            )
            if endpoint is None:
                raise ListenerError("the debugpy listener did not start (see the line above)")
            return endpoint
        listener = debugger.pdb_listener(self.settings)
        return debugger.Endpoint(protocol.DEFAULT_LISTENER, listener.host, listener.port)

    def _emit(self, failure: notice.Failure) -> None:
        from breakpod._core import events

        events.emit(
            protocol.CI_FAILURE,
            test=failure.test,
            error=failure.error,
            where=f"{failure.file}:{failure.line}",
            backend=failure.backend,
            address=failure.address,
            hold_seconds=failure.hold_seconds,
            ci=self.where.ci,
            worker=self.worker,
        )


def _park_uncaptured(capman: Any, *args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` in a test: park with pytest's capture suspended, so the park's
    line (the address to attach to) reaches the CI log while it waits."""
    from breakpod._debug import breakpoints

    if capman is not None:
        capman.suspend_global_capture(in_=True)
    try:
        breakpoints.set_trace(*args, frame=sys._getframe(1), **kwargs)
    finally:
        if capman is not None:
            capman.resume_global_capture()


def _hold_seconds(option: str | None, where: hosting.Hosting) -> float:
    if option is not None:
        return parse_seconds("--breakpod-hold", option)
    var = ENV["hold_seconds"]
    if var in os.environ:
        return parse_seconds(var, os.environ[var])
    return HOLD_IN_CI if where.ci else 0.0


def _env_backend() -> str:
    value = os.environ.get(ENV["backend"], "").strip().lower()
    return (
        value if value in BACKENDS else protocol.DEFAULT_LISTENER
    )  # auto -> pdb: nc is on every runner


def _port(option: str | None, worker: int) -> int:
    var = ENV["port"]
    if option is not None:
        base = parse_port("--breakpod-port", option)
    else:
        base = parse_port(var, os.environ[var]) if var in os.environ else DEFAULT_PORT
    return base + worker if base else 0


def _worker_index() -> int:
    """N for pytest-xdist worker ``gwN`` (0 outside xdist), so workers get distinct ports."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) if match else 0


def _failing_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` cut after the innermost frame that does not set ``__tracebackhide__``.

    ``pytest.fail()``, ``pytest.raises`` and assertion helpers hide their own
    frames; the post-mortem should start in the test's code, as pytest reports it.
    """
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    shown = [i for i, entry in enumerate(entries) if not _hidden(entry)]
    if not shown or shown[-1] == len(entries) - 1:
        return entries[0] if entries else None
    cut: TracebackType | None = None
    for entry in reversed(entries[: shown[-1] + 1]):
        cut = TracebackType(cut, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return cut


def _hidden(entry: TracebackType) -> bool:
    frame = entry.tb_frame
    if frame.f_code.co_filename.startswith("<frozen importlib"):
        return True  # as in Python's own tracebacks
    return bool(frame.f_locals.get("__tracebackhide__", frame.f_globals.get("__tracebackhide__")))


def _original(exc: BaseException) -> BaseException:
    """What the code raised: pytest wraps a test module's import error in a CollectError."""
    if isinstance(exc, pytest.Collector.CollectError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def _traceback_swapped(exc: BaseException, tb: TracebackType | None) -> Iterator[None]:
    """Show the debugger ``tb``; pytest's report was built already, restore it after."""
    full = exc.__traceback__
    exc.__traceback__ = tb
    try:
        yield
    finally:
        exc.__traceback__ = full


@contextlib.contextmanager
def _watch_attach() -> Iterator[threading.Event]:
    """An event set when a debugger client attaches while the block runs."""
    from breakpod._core import events

    attached = threading.Event()

    def sink(event: events.Event) -> None:
        if event.kind == protocol.ATTACHED:
            attached.set()

    events.add_sink(sink)
    try:
        yield attached
    finally:
        events.remove_sink(sink)
