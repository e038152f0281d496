"""The ``breakpod`` command line: what an engineer runs to reach a parked job."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from breakpod import __version__
from breakpod.errors import BreakpodError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="breakpod: %(message)s")
    try:
        return int(args.func(args) or 0)
    except BreakpodError as e:
        print(f"breakpod: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breakpod", description="breakpoint() for pods.")
    parser.add_argument("--version", action="version", version=f"breakpod {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    add_attach(commands)
    return parser


def add_attach(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "attach",
        help="attach to a parked process",
        description="Attach to a remote pdb (or print a VS Code config for a debugpy listener).",
    )
    p.add_argument("target", metavar="HOST:PORT", help="listener address, e.g. 127.0.0.1:5678")
    p.add_argument("--token", help="token for non-loopback listeners (default: $BREAKPOD_TOKEN)")
    p.add_argument(
        "--vscode",
        action="store_true",
        help="print a launch.json for a debugpy listener instead of attaching",
    )
    p.add_argument(
        "--remote-root",
        default=".",
        help="source root inside the container, for pathMappings (default: .)",
    )
    p.add_argument(
        "--local-root",
        default="${workspaceFolder}",
        help="matching local source root (default: ${workspaceFolder})",
    )
    p.set_defaults(func=run_attach)


def run_attach(args: argparse.Namespace) -> int:
    from breakpod import attach, net

    host, port = net.parse_address(args.target)
    if args.vscode:
        print(attach.vscode_launch(host, port, args.remote_root, args.local_root))
        return 0
    attach.attach(host, port, token=args.token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
