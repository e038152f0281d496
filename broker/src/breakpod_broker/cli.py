"""``breakpod-broker serve``: the broker, plus an embedded redis-server without a Redis URL."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from breakpod_broker import __version__
from breakpod_broker.errors import BrokerError


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="breakpod-broker: %(levelname)s %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (BrokerError, ValidationError) as e:
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
        "--dev", action="store_true", help="generate one token per role and print them"
    )
    serve.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from breakpod_broker import serving
    from breakpod_broker.app import create_app
    from breakpod_broker.settings import BrokerSettings

    overrides: dict[str, Any] = {
        "broker_host": args.host,
        "broker_port": args.port,
        "redis_url": args.redis_url,
        "data_dir": args.data_dir,
        "tokens_file": args.tokens_file,
    }
    settings = BrokerSettings(**{k: v for k, v in overrides.items() if v is not None})
    if args.dev:
        settings = settings.model_copy(
            update={"broker_tokens": _dev_tokens(settings.broker_tokens)}
        )
    serving.serve(create_app(settings), settings, args.log_level)
    return 0


def _dev_tokens(existing: str) -> str:
    from breakpod_broker.tokens import dev_tokens

    made = dev_tokens()
    for role, token in made.items():
        print(f"breakpod-broker: dev token for {role.value}: {token}", file=sys.stderr)
    print(f"breakpod-broker: e.g. export BREAKPOD_TOKEN={made[next(iter(made))]}", file=sys.stderr)
    return ",".join([existing, *(f"{r.value}:{t}" for r, t in made.items())]).strip(",")


if __name__ == "__main__":
    sys.exit(main())
