"""``breakpod doctor``: can a debugger reach this process, and what will breakpoint() do?

Each check is one line: a status, what was found, and the fix. ``FAIL`` means
attaching is blocked (the exit status is then 1); ``warn`` means it works with
a caveat; ``info`` is a fact about the environment.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from breakpod import protocol
from breakpod._core import hosting, net
from breakpod._core.config import (
    AGENT_TOKEN_ENV,
    BROKER_URL_ENV,
    ENV,
    SHIM,
    Settings,
    format_seconds,
    parse_bool,
    token_value,
)
from breakpod._core.errors import BreakpodError, BrokerRequestError
from breakpod._debug import breakpoints, debugger
from breakpod._link.client import BrokerClient

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
DEBUGPY = "debugpy"  # the package (and its check), not the listener kind
HTTP_TIMEOUT = 3.0


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str
    found: str
    fix: str = ""


class Context:
    """What the checks read: the environment, the settings, and whether stdin is a TTY."""

    def __init__(self, environ: Mapping[str, str], tty: bool) -> None:
        self.env = environ
        self.tty = tty
        self.where = hosting.detect(environ)
        try:
            self.settings, self.settings_error = Settings.from_env(environ), ""
        except BreakpodError as e:
            self.settings, self.settings_error = Settings(), str(e)


def diagnose(environ: Mapping[str, str] | None = None, *, tty: bool | None = None) -> list[Check]:
    ctx = Context(
        os.environ if environ is None else environ,
        breakpoints.stdin_is_tty() if tty is None else tty,
    )
    return [check for run_check in CHECKS for check in run_check(ctx)]


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        fix = f"\n      {'':<{width}}  fix: {c.fix}" if c.fix else ""
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.found}{fix}")
    failed = sum(c.status == FAIL for c in checks)
    verdict = f"{failed} problem(s) block attaching" if failed else "nothing blocks attaching"
    return "\n".join([*lines, "", f"breakpod doctor: {verdict}"])


def to_json(checks: list[Check]) -> str:
    return json.dumps([dataclasses.asdict(c) for c in checks], indent=2)


def exit_status(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


# -- checks: each yields one or more lines ---------------------------------------------


def check_settings(ctx: Context) -> Iterator[Check]:
    if ctx.settings_error:
        yield Check("settings", FAIL, ctx.settings_error, "fix the variable named above")
    for name in JOB_FLAGS:  # read as the job runs: a bad value is said there, and ignored
        raw = ctx.env.get(name)
        if raw is None:
            continue
        try:
            parse_bool(name, raw)
        except BreakpodError as e:
            yield Check("settings", WARN, f"{e}; the job ignores it", f"fix or unset {name}")


# yes/no variables a job reads as it runs (config.env_flag), beside the Settings
JOB_FLAGS = (
    "BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_REPLAY", "BREAKPOD_HEALTH",
    "BREAKPOD_DISABLE_COMPILE",
)  # fmt: skip


def check_tty(ctx: Context) -> Iterator[Check]:
    s = ctx.settings
    if breakpoints.use_local_pdb(s, tty=ctx.tty):
        yield Check("stdin", OK, "a TTY: breakpoint() opens pdb on this terminal")
        return
    why = "a TTY, but ENABLE_REMOTE_DEBUG=1" if ctx.tty else "not a TTY (headless)"
    if ctx.env.get("PYTHONBREAKPOINT") == SHIM:
        yield Check(
            "stdin",
            OK if ctx.tty else WARN,
            f"{why}: breakpoint() will park on a socket at "
            f"{s.host}:{s.listen_port or 'a free port'} and wait up to "
            f"{format_seconds(s.hold_seconds)} for a debugger",
            f"attach with: breakpod attach {_reachable(s.host)}:{s.listen_port or 'PORT'} "
            "(the process log names the address)",
        )
    elif ctx.tty:
        yield Check("stdin", OK, "a TTY: a plain breakpoint() opens pdb on this terminal")
    else:
        yield Check(
            "stdin",
            WARN,
            f"{why}: a plain breakpoint() fails here (BdbQuit / lost sys.stdin)",
            f"export PYTHONBREAKPOINT={SHIM} (or use breakpod run) so it parks on a socket",
        )


def _reachable(host: str) -> str:
    return "<this host>" if net.is_wildcard(host) else host


def check_breakpoint_hook(ctx: Context) -> Iterator[Check]:
    hook = ctx.env.get("PYTHONBREAKPOINT", "")
    if hook == SHIM:
        yield Check("PYTHONBREAKPOINT", OK, f"{SHIM}: breakpoint() goes through breakpod")
    elif not hook:
        yield Check(
            "PYTHONBREAKPOINT",
            WARN,
            "unset: breakpoint() is plain pdb",
            f"export PYTHONBREAKPOINT={SHIM} (breakpod run sets it)",
        )
    elif hook == "0":
        yield Check("PYTHONBREAKPOINT", WARN, "0: breakpoint() does nothing", "unset it")
    elif not _importable(hook.rpartition(".")[0] or "builtins"):
        yield Check(
            "PYTHONBREAKPOINT", FAIL, f"{hook}: its module is not importable", f"use {SHIM}"
        )
    else:
        yield Check("PYTHONBREAKPOINT", INFO, f"{hook}: breakpoint() calls it instead of breakpod")


def check_post_mortem(ctx: Context) -> Iterator[Check]:
    if ctx.settings.post_mortem:
        yield Check("post-mortem", OK, f"{ENV['post_mortem']}=1: an uncaught exception parks")
    else:
        yield Check(
            "post-mortem",
            INFO,
            "off: an uncaught exception exits as usual",
            f"export {ENV['post_mortem']}=1 (breakpod run sets it) to inspect crashes",
        )


def check_debugpy(ctx: Context) -> Iterator[Check]:
    wants = ctx.settings.backend == protocol.DAP_LISTENER
    if importlib.util.find_spec(DEBUGPY) is None:
        status = FAIL if wants else INFO
        yield Check(
            DEBUGPY,
            status,
            "not installed: the remote pdb backend is used",
            "pip install debugpy",
        )
        return
    import debugpy

    post_mortem = hasattr(debugpy, "trigger_exception_handler")
    note = "" if post_mortem else " (no post-mortem before 1.8.21: crashes use pdb)"
    yield Check(DEBUGPY, OK, f"{debugpy.__version__} importable{note}")


def check_bind(ctx: Context) -> Iterator[Check]:
    s = ctx.settings
    if debugger.choose_backend(s.backend) == protocol.DAP_LISTENER and debugger.token_policy(s):
        yield Check(
            "bind",
            FAIL if s.backend == protocol.DAP_LISTENER else WARN,
            f"the token is required, and init_remote_debugger() picks debugpy "
            f"(BREAKPOD_BACKEND={s.backend}), which cannot check one: it starts no listener",
            "set BREAKPOD_BACKEND=pdb",
        )
        return
    if net.is_loopback(s.host):
        yield Check(
            "bind",
            OK,
            f"{s.host} (loopback): reach it with kubectl port-forward, "
            "docker exec or a 127.0.0.1-published port",
        )
        return
    chosen = debugger.choose_backend(s.backend)  # what init_remote_debugger() would start
    pdb = protocol.DEFAULT_LISTENER
    for backend in dict.fromkeys([pdb, chosen]):
        try:
            net.check_bind(s.host, backend=backend, token=s.token, allow_insecure=s.allow_insecure)
        except BreakpodError:
            found, fix = BIND_FIXES[backend]
            if backend == pdb or s.backend == protocol.DAP_LISTENER:
                yield Check("bind", FAIL, f"{s.host} is {found}", fix)
                return
            yield Check(
                "bind",
                WARN,
                f"{s.host}: init_remote_debugger() picks debugpy "
                "(BREAKPOD_BACKEND=auto) and would refuse it",
                f"{fix}, or set BREAKPOD_BACKEND=pdb",
            )
            return
    token = "token set" if s.token else "no token"
    yield Check("bind", WARN, f"{s.host} is not loopback ({token}): anyone who reaches it may try")


BIND_FIXES = {
    "pdb": (
        "not loopback and no token is set: the remote pdb refuses to listen",
        "set BREAKPOD_LISTENER_TOKEN=<secret> (clients send it first), "
        "or keep BREAKPOD_HOST=127.0.0.1 and use kubectl port-forward / docker exec",
    ),
    "debugpy": (
        "not loopback: debugpy has no authentication, so it refuses without the opt-in",
        "keep BREAKPOD_HOST=127.0.0.1 and use kubectl port-forward, or accept the risk "
        "with BREAKPOD_ALLOW_INSECURE=1",
    ),
}


def check_port(ctx: Context) -> Iterator[Check]:
    host, port = ctx.settings.host, ctx.settings.listen_port
    if port == 0:
        yield Check("port", OK, "0: each listener takes a free port (the log names it)")
        return
    error = _bind_error(host, port)
    if error is None:
        yield Check("port", OK, f"{host}:{port} is free")
    elif error.errno == errno.EADDRINUSE:
        yield Check(
            "port",
            WARN,
            f"{host}:{port} is in use: breakpod falls back to a free port",
            f"set {ENV['port']} to a free port so the address is predictable",
        )
    else:
        yield Check(
            "port",
            FAIL,
            f"cannot listen on {host}:{port}: {error.strerror}",
            f"set {ENV['host']} to an address of this machine, e.g. 127.0.0.1",
        )


def _bind_error(host: str, port: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener does
        try:
            sock.bind((host, port))
        except OSError as e:
            return e
    return None


def check_broker(ctx: Context) -> Iterator[Check]:
    url = ctx.env.get(BROKER_URL_ENV, "").rstrip("/")
    if not url:
        yield Check(
            "broker",
            INFO,
            f"none configured ({BROKER_URL_ENV}): parks are announced in the log only",
        )
        return
    yield broker_check(url, token_value(AGENT_TOKEN_ENV))


def broker_check(url: str, token: str | None) -> Check:
    """Health (no token), then an authenticated call, through the agent's own client."""
    status, why = _call(url, None, BrokerClient.healthz)
    if status != 200:
        return Check(
            "broker", FAIL, f"{url} unreachable ({why})", f"check {BROKER_URL_ENV} and the network"
        )
    if not token:
        return Check("broker", FAIL, f"{url} is up, but no token is set", f"set {AGENT_TOKEN_ENV}")
    status, why = _call(url, token, BrokerClient.whoami)  # any valid token, whatever its role
    if status in (401, 403):
        return Check(
            "broker",
            FAIL,
            f"{url} rejected the token ({why})",
            f"set {AGENT_TOKEN_ENV} to an agent token of the broker",
        )
    if status is None or status >= 400:
        return Check("broker", WARN, f"{url} is up; the token check answered {why}")
    return Check("broker", OK, f"{url} reachable, token accepted")


def _call(
    url: str, token: str | None, call: Callable[[BrokerClient], Any]
) -> tuple[int | None, str]:
    """(HTTP status, what to show): None when the broker was not reached."""
    try:
        client = BrokerClient(url, token, timeout=HTTP_TIMEOUT)
        try:
            call(client)
        finally:
            client.close()
    except BrokerRequestError as e:
        return e.status, f"HTTP {e.status}" if e.status is not None else str(e)
    return 200, "HTTP 200"


def check_torch(ctx: Context) -> Iterator[Check]:
    if importlib.util.find_spec("torch") is None:
        yield Check("torch", INFO, "not installed")
        return
    import torch

    yield Check("torch", OK, f"{torch.__version__}")
    yield _cuda(ctx, torch)
    yield _compile(ctx)


def _cuda(ctx: Context, torch: Any) -> Check:
    visible = ctx.env.get("CUDA_VISIBLE_DEVICES")
    cuda = torch.cuda
    if cuda.is_available():
        names = ", ".join(cuda.get_device_name(i) for i in range(cuda.device_count()))
        return Check("cuda", OK, f"{cuda.device_count()} device(s): {names}")
    note = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return Check("cuda", INFO, f"no CUDA device visible{note}")


def _compile(ctx: Context) -> Check:
    raw = ctx.env.get("TORCH_COMPILE_DISABLE", "")
    try:
        disabled = parse_bool("TORCH_COMPILE_DISABLE", raw)
    except BreakpodError:
        disabled = False
    if disabled:
        return Check(
            "torch.compile",
            OK,
            "disabled (TORCH_COMPILE_DISABLE=1): breakpoints stop in model code",
        )
    return Check(
        "torch.compile",
        WARN,
        "enabled: breakpoint() inside compiled functions causes graph breaks or is skipped",
        "export TORCH_COMPILE_DISABLE=1 while debugging (breakpod run sets it)",
    )


def check_hosting(ctx: Context) -> Iterator[Check]:
    where = ctx.where
    if where.kubernetes:
        if where.pod and where.namespace:
            yield Check(
                protocol.KUBERNETES,
                OK,
                f"pod {where.namespace}/{where.pod}: kubectl port-forward reaches it",
            )
        else:
            yield Check(
                protocol.KUBERNETES,
                WARN,
                "in a pod, but POD_NAME / POD_NAMESPACE are not set: attach hints guess the pod",
                "add downward-API env POD_NAME (metadata.name), POD_NAMESPACE (metadata.namespace)",
            )
    if where.container:
        yield Check(
            "container",
            INFO,
            f"{where.container} (hostname {where.hostname}): "
            "reach it with docker exec or a published port",
        )
    if where.ci:
        yield Check("ci", INFO, f"{where.ci}: pytest --breakpod holds failures 600s by default")
    if not (where.kubernetes or where.container or where.ci):
        yield Check("environment", INFO, "not in Kubernetes, a container or CI")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


Checker = Callable[[Context], Iterator[Check]]
CHECKS: list[Checker] = [
    check_settings,
    check_tty,
    check_breakpoint_hook,
    check_post_mortem,
    check_debugpy,
    check_bind,
    check_port,
    check_broker,
    check_torch,
    check_hosting,
]
