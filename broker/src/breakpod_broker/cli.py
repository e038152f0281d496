"""``breakpod-broker serve``: the broker, plus an embedded redis-server without a Redis URL."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from breakpod_broker import __version__
from breakpod_broker.errors import BrokerError, ConfigError
from breakpod_broker.settings import ENV_PREFIX, BrokerSettings
from breakpod_broker.tokens import (
    MIN_TOKEN_LENGTH,
    Role,
    dev_tokens,
    load_tokens_file,
    parse_token_pairs,
)

DEV_TOKENS_FILE = "dev-tokens.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="breakpod-broker: %(levelname)s %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except BrokerError as e:
        print(f"breakpod-broker: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breakpod-broker", description="The breakpod broker.")
    parser.add_argument("--version", action="version", version=f"breakpod-broker {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run the broker", description="Run the broker HTTP API."
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1; $BREAKPOD_BROKER_HOST)")
    serve.add_argument("--port", type=int, help="port (default 8765; $BREAKPOD_BROKER_PORT)")
    serve.add_argument("--redis-url", help="Redis to use ($BREAKPOD_REDIS_URL); default: embedded")
    serve.add_argument("--data-dir", type=Path, help="embedded Redis data ($BREAKPOD_DATA_DIR)")
    serve.add_argument("--tokens-file", type=Path, help="YAML/JSON token -> role map")
    serve.add_argument(
        "--dev",
        action="store_true",
        help="one token per role, kept in the data directory (reused at restarts); "
        "prints the exports for the job and the CLI",
    )
    serve.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from breakpod_broker import serving
    from breakpod_broker.app import create_app

    settings = checked_settings(args)  # everything checked before Redis or a port is touched
    if args.dev:
        settings = settings.model_copy(update={"broker_tokens": _with_dev_tokens(settings)})
    serving.serve(create_app(settings), settings, args.log_level)
    return 0


def checked_settings(args: argparse.Namespace) -> BrokerSettings:
    """The settings from the flags and the environment, each checked: a bad one is a
    :class:`ConfigError` whose one line names the setting (exit 2)."""
    overrides: dict[str, Any] = {
        "broker_host": args.host,
        "broker_port": args.port,
        "redis_url": args.redis_url,
        "data_dir": args.data_dir,
        "tokens_file": args.tokens_file,
    }
    try:
        settings = BrokerSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
    except SettingsError as e:  # a JSON setting that does not parse
        named = re.search(r'field "(\w+)"', str(e))
        field = env_name(named.group(1)) if named else "a setting"
        raise ConfigError(f"{field} is not valid JSON ({e.__cause__ or e})") from None
    _check_tokens(settings)
    _check_files(settings)
    return settings


def _one_line(error: ValidationError) -> str:
    """pydantic's report, one clause per bad setting under its variable's name."""
    clauses = []
    for err in error.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        rest = ".".join(str(part) for part in err["loc"][1:])
        value = f"={err['input']!r}" if not isinstance(err["input"], dict | list) else ""
        clauses.append(f"{env_name(field)}{'.' + rest if rest else ''}{value}: {err['msg']}")
    return "; ".join(clauses)


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def _check_tokens(settings: BrokerSettings) -> None:
    try:
        parse_token_pairs(settings.broker_tokens)
    except ConfigError as e:
        raise ConfigError(f"{env_name('broker_tokens')}: {e}") from None
    if settings.tokens_file is not None:
        try:
            load_tokens_file(settings.tokens_file)
        except ConfigError as e:
            raise ConfigError(f"{env_name('tokens_file')} (--tokens-file): {e}") from None


def _check_files(settings: BrokerSettings) -> None:
    for field in ("tls_cert_file", "tls_key_file"):
        path = getattr(settings, field)
        if path is not None and not path.is_file():
            raise ConfigError(f"{env_name(field)}={str(path)!r}: no such file")
    if settings.tls_key_file is not None and settings.tls_cert_file is None:
        raise ConfigError(f"{env_name('tls_key_file')} is set without {env_name('tls_cert_file')}")


def _with_dev_tokens(settings: BrokerSettings) -> str:
    """One token per role, kept in the data directory: a restart reuses them, so jobs
    that already hold one are not refused. Prints the exports for both sides."""
    path = settings.data_dir / DEV_TOKENS_FILE
    made, reused = _dev_tokens_in(path)
    say = functools.partial(print, file=sys.stderr)
    say(f"breakpod-broker: dev tokens {'reused from' if reused else 'kept in'} {path}")
    url = f"http://{settings.broker_host}:{settings.broker_port}"
    say(
        f"breakpod-broker: for the job:  export BREAKPOD_BROKER_URL={url} "
        f"BREAKPOD_AGENT_TOKEN={made[Role.agent]}"
    )
    say(
        f"breakpod-broker: for the CLI:  export BREAKPOD_BROKER_URL={url} "
        f"BREAKPOD_BROKER_TOKEN={made[Role.admin]}"
    )
    say(f"breakpod-broker: read-only viewer token: {made[Role.viewer]}")
    pairs = (f"{role.value}:{token}" for role, token in made.items())
    return ",".join([settings.broker_tokens, *pairs]).strip(",")


def _dev_tokens_in(path: Path) -> tuple[dict[Role, str], bool]:
    """(one token per role, whether they were read back): the file's, else new ones,
    written readable by this user only."""
    try:
        stored = json.loads(path.read_text())
        made = {Role(role): str(token) for role, token in stored.items()}
        if set(made) == set(Role) and all(len(t) >= MIN_TOKEN_LENGTH for t in made.values()):
            return made, True
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # none yet, or not one this command wrote: make new ones
    made = dev_tokens()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({role.value: token for role, token in made.items()}, f, indent=2)
    return made, False


if __name__ == "__main__":
    sys.exit(main())
