"""``breakpod run -- python train.py ...``: any program, with breakpod's debug switches on.

The child gets ``PYTHONBREAKPOINT=breakpod.set_trace`` (``breakpoint()`` parks
when headless), ``BREAKPOD_POST_MORTEM=1`` (``breakpod_autostart.pth`` installs
the crash hook at interpreter start), ``ENABLE_REMOTE_DEBUG=1`` and
``TORCH_COMPILE_DISABLE=1``. Nothing else changes: signals sent to ``breakpod
run`` reach the child, and its exit status is ours (``128 + N`` for signal N).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence

from breakpod._core.config import (
    BACKENDS,
    BROKER_URL_ENV,
    DISABLE_COMPILE_ENV,
    ENV,
    SHIM,
    parse_choice,
    parse_port,
    parse_seconds,
)
from breakpod._core.errors import ConfigError

FORWARDED = frozenset(
    {
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    }
)
SI_KERNEL = 0x80  # Linux si_code of a signal the kernel sent (terminal Ctrl-C, hangup)


def debug_env(
    environ: Mapping[str, str],
    *,
    hold: str | None = None,
    port: str | None = None,
    host: str | None = None,
    broker: str | None = None,
    backend: str | None = None,
    keep_compile: bool = False,
) -> dict[str, str]:
    """``environ`` plus breakpod's switches; bad option values raise ConfigError."""
    env = dict(environ)
    env.update({"PYTHONBREAKPOINT": SHIM, ENV["post_mortem"]: "1"})
    env[ENV["enabled"]] = "1"
    if not keep_compile:  # breakpoints inside compiled regions would be skipped
        env.update({"TORCH_COMPILE_DISABLE": "1", DISABLE_COMPILE_ENV: "1"})
    if hold is not None:
        parse_seconds("--hold", hold)
    if port is not None:
        parse_port("--port", port)
    if backend is not None:
        parse_choice(*BACKENDS)("--backend", backend)
    chosen = {
        ENV["hold_seconds"]: hold,
        ENV["port"]: port,
        ENV["host"]: host,
        ENV["backend"]: backend,
        BROKER_URL_ENV: broker,
    }
    env.update({var: value for var, value in chosen.items() if value is not None})
    return env


def run(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``command`` to its end, forwarding signals; its exit status, shell style."""
    if not command:
        raise ConfigError("nothing to run: use breakpod run [options] -- python train.py ...")
    if not hasattr(signal, "sigtimedwait"):  # macOS: no sigtimedwait
        return _run_with_handlers(command, env)
    with _signals_blocked() as restore:
        try:
            proc = subprocess.Popen(list(command), env=dict(env), preexec_fn=restore)
        except OSError as e:
            return _not_started(command[0], e)
        _supervise(proc)
    return exit_status(proc.returncode)


def _not_started(program: str, error: OSError) -> int:
    """Say why, and exit like a shell: 127 not found, 126 not executable."""
    print(f"breakpod: cannot run {program!r}: {error.strerror or error}", file=sys.stderr)
    return 127 if isinstance(error, FileNotFoundError) else 126


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _signals_blocked() -> Iterator[_Restore]:
    """Queue the forwarded signals (and SIGCHLD) for :func:`_supervise` to read.

    Blocking, rather than handlers, tells who sent a signal: the kernel already
    delivered a terminal's Ctrl-C to the child's process group, ``kill`` did not.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {signal.SIGCHLD})
    try:
        yield _Restore(previous)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Restore:
    """Runs in the child before exec: it starts with the caller's signal mask."""

    def __init__(self, mask: Iterable[int]) -> None:
        self.mask = mask

    def __call__(self) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)


def _supervise(proc: subprocess.Popen[bytes]) -> None:
    waited = FORWARDED | {signal.SIGCHLD}
    while proc.poll() is None:
        info = signal.sigtimedwait(waited, 1.0)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if info.si_code != SI_KERNEL:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(info.si_signo)


def _run_with_handlers(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Fallback: forward with handlers; SIGINT only comes from the terminal here."""
    try:
        proc = subprocess.Popen(list(command), env=dict(env))
    except OSError as e:
        return _not_started(command[0], e)
    forward = FORWARDED - {signal.SIGINT}
    previous = {sig: signal.signal(sig, lambda n, _f: proc.send_signal(n)) for sig in forward}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_status(proc.returncode)
