"""Agent settings: explicit argument > environment variable > safe default.

Every knob the agent reads from the environment is listed in ``ENV`` so the
README, ``breakpod doctor`` and the tests share one description of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from breakpod.errors import ConfigError

DEFAULT_PORT = 5678
SHIM = "breakpod.set_trace"  # the PYTHONBREAKPOINT value
DISABLE_COMPILE_ENV = "BREAKPOD_DISABLE_COMPILE"
BACKENDS = ("auto", "pdb", "debugpy")  # auto: debugpy when importable, else pdb
BROKER_URL_ENV = "BREAKPOD_BROKER_URL"  # read by the emitter, the CLI, run and doctor
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})

ENV: dict[str, str] = {
    "enabled": "ENABLE_REMOTE_DEBUG",
    "host": "BREAKPOD_HOST",
    "port": "BREAKPOD_PORT",
    "local_rank": "LOCAL_RANK",
    "token": "BREAKPOD_TOKEN",
    "require_token": "BREAKPOD_REQUIRE_TOKEN",
    "allow_insecure": "BREAKPOD_ALLOW_INSECURE",
    "backend": "BREAKPOD_BACKEND",
    "on_detach": "BREAKPOD_ON_DETACH",
    "quit_mode": "BREAKPOD_QUIT",
    "wait_timeout": "BREAKPOD_WAIT_TIMEOUT",
    "hold_seconds": "BREAKPOD_HOLD_SECONDS",
    "post_mortem": "BREAKPOD_POST_MORTEM",
}


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def parse_seconds(name: str, raw: str) -> float:
    """Seconds as a number; ``inf``/``forever``/a negative number mean no limit."""
    value = raw.strip().lower()
    if value in {"inf", "forever", "infinite", "none"}:
        return math.inf
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number of seconds: use e.g. 300, 0, or 'forever'"
        ) from None
    return math.inf if seconds < 0 else seconds


def format_seconds(seconds: float) -> str:
    """The inverse of :func:`parse_seconds`, for messages."""
    return "forever" if math.isinf(seconds) else f"{seconds:g}s"


def parse_port(name: str, raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r} is not a TCP port: use 0..65535 (0 = any free port)")
    return port


def parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def parse_choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ConfigError(f"{name}={raw!r} is not one of: {', '.join(choices)}")
        return value

    return parse


def parse_str(name: str, raw: str) -> str | None:
    return raw or None


PARSERS: dict[str, Callable[[str, str], Any]] = {
    "enabled": parse_bool,
    "host": lambda name, raw: raw.strip() or "127.0.0.1",
    "port": parse_port,
    "local_rank": parse_int,
    "token": parse_str,
    "require_token": parse_bool,
    "allow_insecure": parse_bool,
    "backend": parse_choice(*BACKENDS),
    "on_detach": parse_choice("continue", "wait"),
    "quit_mode": parse_choice("detach", "exit"),
    "wait_timeout": parse_seconds,
    "hold_seconds": parse_seconds,
    "post_mortem": parse_bool,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the agent needs to know; build it with :meth:`from_env`."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    local_rank: int = 0
    token: str | None = None
    require_token: bool = False  # also on loopback: other users of a shared host reach it
    allow_insecure: bool = False
    backend: str = "auto"
    on_detach: str = "continue"
    quit_mode: str = "detach"
    wait_timeout: float = 300.0
    hold_seconds: float = 300.0
    post_mortem: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read the environment, then apply the non-``None`` overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, var in ENV.items():
            if var in env:
                values[field] = PARSERS[field](var, env[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def __post_init__(self) -> None:
        if self.port and self.port + self.local_rank > 65535:
            raise ConfigError(
                f"BREAKPOD_PORT={self.port} + LOCAL_RANK={self.local_rank} is past 65535: "
                "use a lower base port"
            )
        if self.require_token and not self.token:
            raise ConfigError("BREAKPOD_REQUIRE_TOKEN=1 needs BREAKPOD_TOKEN to be set")

    @property
    def listen_port(self) -> int:
        """The port this process binds: base port + LOCAL_RANK (0 stays 0 = any)."""
        return self.port + self.local_rank if self.port else 0
