"""Agent settings: explicit argument > environment variable > safe default.

Every knob the agent reads from the environment is listed in ``ENV`` so the
README, ``breakpod doctor`` and the tests share one description of it.

A bad value never silently turns protection off. :meth:`Settings.load`
reports each bad value by name: an ordinary one falls back to its own
default, alone; a bad or missing *security* value (``SECURITY``) keeps every
other value but sets ``Settings.refused``, and no listener starts in this
process (the job runs on without one). :meth:`Settings.from_env` is the strict
form for explicit API calls: it raises on the first bad value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from breakpod import protocol
from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError

DEFAULT_PORT = 5678
SHIM = "breakpod.set_trace"  # the PYTHONBREAKPOINT value
DISABLE_COMPILE_ENV = "BREAKPOD_DISABLE_COMPILE"
BACKENDS = ("auto", *protocol.LISTENERS)  # auto: debugpy when importable, else pdb
BROKER_URL_ENV = "BREAKPOD_BROKER_URL"  # read by the emitter, the CLI, run and doctor
# Three secrets, three names: who may attach to this process's listener, what the
# job's agent shows the broker (role agent), what the engineer's CLI shows it
# (viewer or admin). The old single name still works for one release.
LISTENER_TOKEN_ENV = "BREAKPOD_LISTENER_TOKEN"
AGENT_TOKEN_ENV = "BREAKPOD_AGENT_TOKEN"
BROKER_TOKEN_ENV = "BREAKPOD_BROKER_TOKEN"
DEPRECATED_TOKEN_ENV = "BREAKPOD_TOKEN"
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})

ENV: dict[str, str] = {
    "enabled": "ENABLE_REMOTE_DEBUG",
    "host": "BREAKPOD_HOST",
    "port": "BREAKPOD_PORT",
    "local_rank": "LOCAL_RANK",
    "token": LISTENER_TOKEN_ENV,
    "require_token": "BREAKPOD_REQUIRE_TOKEN",
    "allow_insecure": "BREAKPOD_ALLOW_INSECURE",
    "backend": "BREAKPOD_BACKEND",
    "on_detach": "BREAKPOD_ON_DETACH",
    "quit_mode": "BREAKPOD_QUIT",
    "wait_timeout": "BREAKPOD_WAIT_TIMEOUT",
    "hold_seconds": "BREAKPOD_HOLD_SECONDS",
    "post_mortem": "BREAKPOD_POST_MORTEM",
    "attach_idle": "BREAKPOD_ATTACH_IDLE",
}
# What each variable means, for `docs/settings.md` (generated: docs/gen_settings.py).
HELP: dict[str, str] = {
    "enabled": "lets `init_remote_debugger()` start a listener",
    "host": "listener address (a non-loopback one needs a token, or the opt-in for debugpy)",
    "port": "base port (+ `LOCAL_RANK`); `0` = any free port",
    "local_rank": "this process's index on its node (torchrun sets it), added to the port",
    "token": "token a remote pdb client must send first (8+ characters); "
    "required on non-loopback binds",
    "require_token": "require the token on loopback too (hosts shared with other users)",
    "allow_insecure": "allow debugpy on a non-loopback address (it has no authentication)",
    "backend": "`auto`, `pdb` or `debugpy` (auto: debugpy when installed)",
    "on_detach": "`wait`: a disconnect waits for the next client",
    "quit_mode": "`exit`: `q` raises `BdbQuit` as in pdb",
    "wait_timeout": "limit for `init_remote_debugger(wait=True)`",
    "hold_seconds": "how long a park waits for a client (`forever` = no limit)",
    "post_mortem": "post-mortem on uncaught exceptions",
    "attach_idle": "an attached client silent this long is dropped; the park waits again",
}
# Variables outside Settings, read by the broker link and the CLI: (default, meaning).
OTHER_ENV: dict[str, tuple[str, str]] = {
    BROKER_URL_ENV: ("unset", "the broker's URL; unset: parks are announced in the log only"),
    AGENT_TOKEN_ENV: ("unset", "the job's token for the broker (role agent)"),
    BROKER_TOKEN_ENV: ("unset", "the CLI's token for the broker (role viewer or admin)"),
    DEPRECATED_TOKEN_ENV: (
        "unset",
        "deprecated: stands in for each of the three tokens above this release",
    ),
}
# Variables read by one feature each, documented on that feature's page: (default,
# meaning, page). A test checks that every BREAKPOD_* name in the agent is listed.
FEATURE_ENV: dict[str, tuple[str, str, str]] = {
    "BREAKPOD_MONITOR": (
        "on",
        "`0` makes `watch()` install nothing (`AI_DEBUG_MODE=0` too)",
        "monitors.md",
    ),
    "BREAKPOD_MONITOR_TIER": (
        "sentinel",
        "`detailed`: hooks on every module as well (the sentinel tier hooks none and localizes "
        "a NaN by replaying its step)",
        "monitors.md",
    ),
    "BREAKPOD_DETAILED_STEPS": (
        "100",
        "steps the detailed tier stays on after a replay that did not reproduce its step",
        "monitors.md",
    ),
    "BREAKPOD_SKIP_ON_DEVICE": (
        "on",
        "a fused optimizer (`fused=True`) skips an update whose gradients are NaN/Inf on the "
        "device, with no host read, as GradScaler does; `0` applies it",
        "monitors.md",
    ),
    "BREAKPOD_ON_EXPIRE": (
        "skip a non-finite update, else continue",
        "an anomaly park nobody attached to: `continue`, `skip` the update, or `exit` 75",
        "monitors.md",
    ),
    "BREAKPOD_DISABLE_COMPILE": (
        "off",
        "`1`: `torch.compile` runs eager, so module hooks run",
        "monitors.md",
    ),
    "BREAKPOD_FLIGHT_STEPS": (
        "64",
        "steps the flight recorder keeps per module; `0` = off",
        "timetravel.md",
    ),
    "BREAKPOD_REPLAY": (
        "on when a rule parks or in debug mode",
        "keep each step's inputs, RNG and output gradient for `replay`/`whatif`",
        "timetravel.md",
    ),
    "BREAKPOD_STALL_AFTER": (
        "off (debug mode: 10x the p99 step, at least 60 s)",
        "seconds without a step before a stall is reported",
        "many-ranks.md",
    ),
    "BREAKPOD_AUTO_STEPS": (
        "on in debug mode",
        "`0`: an optimizer's step is no step boundary (stalls and job-wide breaks then need "
        "`breakpod.step()`)",
        "frameworks.md",
    ),
    "BREAKPOD_AUTO_WATCH": (
        "on in debug mode",
        "`0`: the model is not found and watched for anomalies without code",
        "frameworks.md",
    ),
    "BREAKPOD_RULES": (
        "unset",
        "a YAML rules file for the model debug mode watches with no code",
        "frameworks.md",
    ),
    "BREAKPOD_JOB": (
        "torchrun's run id, the pod's or script's name",
        "the job a session belongs to",
        "many-ranks.md",
    ),
    "BREAKPOD_HEALTH": (
        "on",
        "`0` makes every `breakpod.health` phase timer a no-op",
        "exporters.md",
    ),
    "BREAKPOD_CI": ("off", "`1`: the pytest plugin holds failed tests for a debugger", "ci.md"),
    "BREAKPOD_SESSION_ID": ("generated", "this process's session id at the broker", "broker.md"),
    "BREAKPOD_EMIT_QUEUE": (
        "10000",
        "events queued for the broker before the oldest are dropped",
        "broker.md",
    ),
    "BREAKPOD_ATTACH_ADDRESS": (
        "unset",
        "the address engineers attach to, when not the listener's own",
        "broker.md",
    ),
    "BREAKPOD_RUNTIME": (
        "detected",
        "`kubernetes`, `compose`, `docker` or `local`: how attach commands are written",
        "broker.md",
    ),
    "BREAKPOD_BROKER_CA": ("system CAs", "a CA bundle for an `https://` broker", "deployment.md"),
}
# Who may connect to the listener: a mistake in one of these must not open it up.
SECURITY = frozenset({"host", "token", "require_token", "allow_insecure"})
MAX_SECONDS = 1e9  # 31 years: any longer limit is no limit (a deadline must stay a time)
MIN_TOKEN_LENGTH = 8  # the broker's minimum too (breakpod_broker.auth.MIN_TOKEN_LENGTH)
HOST_CHARS = re.compile(r"[A-Za-z0-9.:%_-]+")  # names, IPv4, IPv6 (with a zone)


_deprecation_said = False  # one line per process, whichever setting read the old name


def token_env(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(the variable read, its value) for the token setting ``name``; the deprecated
    ``BREAKPOD_TOKEN`` stands in for a missing one this release, with one line saying so."""
    env = os.environ if environ is None else environ
    if name in env:
        return name, env[name]
    if DEPRECATED_TOKEN_ENV not in env:
        return None
    _say_deprecated()
    return DEPRECATED_TOKEN_ENV, env[DEPRECATED_TOKEN_ENV]


def token_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    found = token_env(name, environ)
    return None if found is None else found[1]


def _say_deprecated() -> None:
    global _deprecation_said
    if _deprecation_said:
        return
    _deprecation_said = True
    print(
        f"breakpod: {DEPRECATED_TOKEN_ENV} is deprecated and goes away in the next release: "
        f"set {LISTENER_TOKEN_ENV} (debugger listener), {AGENT_TOKEN_ENV} (job to broker) "
        f"or {BROKER_TOKEN_ENV} (CLI to broker) instead",
        file=sys.__stderr__ or sys.stderr,
    )


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable a job reads as it runs: a value that is neither is said, once
    per variable and value, and the default holds (a typo must not stop the job)."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return parse_bool(name, raw)
    except ConfigError as e:
        if (name, raw) not in _flags_said:
            _flags_said.add((name, raw))
            announce(f"{e}; keeping the default ({'on' if default else 'off'})")
        return default


_flags_said: set[tuple[str, str]] = set()


def parse_seconds(name: str, raw: str) -> float:
    """Seconds as a number from 0 to 31 years; ``forever`` (``inf``, ``none``) for no
    limit. A negative number or one past 31 years (``1e400``) is refused: they read
    as no limit, which only the word should say."""
    value = raw.strip().lower()
    if value in {"inf", "forever", "infinite", "none"}:
        return math.inf
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_SECONDS:  # NaN too
        raise ConfigError(
            f"{name}={raw!r} is not a number of seconds from 0 to {MAX_SECONDS:g}: "
            "use e.g. 300, 0, or 'forever'"
        )
    return seconds


def format_seconds(seconds: float) -> str:
    """The inverse of :func:`parse_seconds`, for messages."""
    return "forever" if math.isinf(seconds) else f"{seconds:g}s"


def parse_port(name: str, raw: str) -> int:
    try:
        port = int(raw) if raw.strip().isascii() else -1
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r} is not a TCP port: use 0..65535 (0 = any free port)")
    return port


def enable_argument(value: object) -> bool | None:
    """``init_remote_debugger(enable=...)``: a bool, or text read as ENABLE_REMOTE_DEBUG is
    (``"false"`` is off: its truthiness said on)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return parse_bool("enable", value)
    raise ConfigError(f"enable={value!r} is not a boolean: use True or False")


def port_argument(value: object) -> int | None:
    """``init_remote_debugger(port=...)``: an int or its text, 0..65535 (``True`` is not
    port 1; ``"x"`` or ``-1`` is this error, not one from the socket or debugpy)."""
    if value is None or isinstance(value, str):
        return None if value is None else parse_port("port", value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise ConfigError(f"port={value!r} is not a TCP port: use 0..65535 (0 = any free port)")


def parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def parse_local_rank(name: str, raw: str) -> int:
    """A process's index on its node (torchrun sets it): 0..65535, added to the port."""
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if not 0 <= rank <= 65535:
        raise ConfigError(
            f"{name}={raw!r} is not a local rank: use a non-negative integer "
            "(torchrun sets it), or unset it"
        )
    return rank


def parse_token(name: str, raw: str) -> str | None:
    """Stripped (a token read from a file ends in a newline), as the CLI strips it."""
    token = raw.strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(
            f"{name} must be at least {MIN_TOKEN_LENGTH} printable characters without spaces: "
            "use a random one, e.g. from `openssl rand -hex 16`"
        )
    return token


def parse_host(name: str, raw: str) -> str:
    host = raw.strip().strip("[]") or "127.0.0.1"
    if not HOST_CHARS.fullmatch(host) or not _labels_fit(host):
        raise ConfigError(
            f"{name}={raw!r} is not a host name or IP address: use e.g. 127.0.0.1 (the default)"
        )
    return host


def _labels_fit(host: str) -> bool:
    """No empty or over-long label (``a..b``), which the name lookup refuses with an error
    of its own."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def parse_choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ConfigError(f"{name}={raw!r} is not one of: {', '.join(choices)}")
        return value

    return parse


PARSERS: dict[str, Callable[[str, str], Any]] = {
    "enabled": parse_bool,
    "host": parse_host,
    "port": parse_port,
    "local_rank": parse_local_rank,
    "token": parse_token,
    "require_token": parse_bool,
    "allow_insecure": parse_bool,
    "backend": parse_choice(*BACKENDS),
    "on_detach": parse_choice("continue", "wait"),
    "quit_mode": parse_choice("detach", "exit"),  # pdb's q, not the command
    "wait_timeout": parse_seconds,
    "hold_seconds": parse_seconds,
    "post_mortem": parse_bool,
    "attach_idle": parse_seconds,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the agent needs to know; build it with :meth:`load` or :meth:`from_env`."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    local_rank: int = 0
    token: str | None = None
    require_token: bool = False  # also on loopback: other users of a shared host reach it
    allow_insecure: bool = False
    backend: str = "auto"
    on_detach: str = "continue"
    quit_mode: str = "detach"  # pdb's q leaves the job running
    wait_timeout: float = 300.0
    hold_seconds: float = 300.0
    post_mortem: bool = False
    attach_idle: float = 900.0  # an attached client silent this long is dropped
    refused: str | None = None  # why no listener may start (a bad security setting)

    @classmethod
    def load(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> tuple[Settings, list[str]]:
        """Settings from the environment plus the non-``None`` overrides, never raising,
        and one line per value that fell back (what was wrong, what to do). Bad
        security values are not among those lines: they make up ``refused``, which
        whoever tries to listen raises (a breakpoint() announces it and continues)."""
        values, problems = _read_env(os.environ if environ is None else environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        problems += _check_together(values, problems)
        lines = [_fell_back(field, message) for field, message in problems if field not in SECURITY]
        refusals = [message for field, message in problems if field in SECURITY]
        if refusals:
            values["refused"] = "; ".join(refusals) + "; no debugger listener in this process"
        return cls(**values), lines

    @classmethod
    def for_listener(
        cls,
        *,
        port: object = None,
        host: str | None = None,
        backend: str | None = None,
        enable: object = None,
    ) -> tuple[Settings, list[str]]:
        """``init_remote_debugger()``'s arguments over the environment, as :meth:`load`
        reads them; :class:`ConfigError` for a ``port`` or ``enable`` that is not one."""
        port, enabled = port_argument(port), enable_argument(enable)
        return cls.load(port=port, host=host, backend=backend, enabled=enabled)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Strict: read the environment, apply the non-``None`` overrides, and raise
        :class:`ConfigError` naming the first bad value."""
        env = os.environ if environ is None else environ
        values, problems = _read_env(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        problems += _check_together(values, problems)
        if problems:
            raise ConfigError(problems[0][1])
        return cls(**values)

    def __post_init__(self) -> None:
        if self.port and self.port + self.local_rank > 65535:
            raise ConfigError(_past_65535(self.port, self.local_rank))
        if self.require_token and not self.token and not self.refused:
            raise ConfigError(_TOKEN_MISSING)

    @property
    def listen_port(self) -> int:
        """The port this process binds: base port + LOCAL_RANK (0 stays 0 = any)."""
        return self.port + self.local_rank if self.port else 0


_TOKEN_MISSING = (
    f"{ENV['require_token']}=1 needs {ENV['token']} to be set "
    f"({MIN_TOKEN_LENGTH}+ characters, e.g. from `openssl rand -hex 16`)"
)


def _read_env(env: Mapping[str, str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Each variable parsed on its own: a bad one is left out (its default stays)."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for field, var in ENV.items():
        found = token_env(var, env) if field == "token" else (var, env[var]) if var in env else None
        if found is None:
            continue
        try:
            values[field] = PARSERS[field](*found)
        except ConfigError as e:
            problems.append((field, str(e)))
    return values, problems


def _check_together(values: dict[str, Any], known: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rules across variables; a port past 65535 falls back to any free port (0)."""
    problems: list[tuple[str, str]] = []
    port, rank = values.get("port", DEFAULT_PORT), values.get("local_rank", 0)
    if port and port + rank > 65535:
        values["port"] = 0
        problems.append(("port", _past_65535(port, rank)))
    token_reported = any(field == "token" for field, _ in known)  # a bad one: said why
    if values.get("require_token") and not values.get("token") and not token_reported:
        problems.append(("token", _TOKEN_MISSING))
    return problems


def _fell_back(field: str, message: str) -> str:
    if field == "port" and "past 65535" in message:
        return f"{message}; listening on any free port instead"
    default = getattr(Settings, field)
    shown = format_seconds(default) if isinstance(default, float) else repr(default)
    return f"{message}; using the default {shown} for this one"


def _past_65535(port: int, rank: int) -> str:
    return f"{ENV['port']}={port} + {ENV['local_rank']}={rank} is past 65535: use a lower base port"
