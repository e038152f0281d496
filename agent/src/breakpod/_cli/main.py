"""The ``breakpod`` command line: what an engineer runs to reach a parked job."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence

from breakpod import __version__, protocol
from breakpod._core.config import BACKENDS, BROKER_TOKEN_ENV, LISTENER_TOKEN_ENV
from breakpod._core.errors import BreakpodError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="breakpod: %(message)s")
    take_deprecated_flags(args)
    try:
        return int(args.func(args) or 0)
    except BreakpodError as e:
        print(f"breakpod: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


DEPRECATED_FLAGS = (("old_listener_token", "listener_token"), ("old_broker_token", "broker_token"))


def take_deprecated_flags(args: argparse.Namespace) -> None:
    """``--token`` meant the listener's token for attach and the broker's elsewhere:
    it still works this release, with one line naming the flag that replaces it."""
    for old, new in DEPRECATED_FLAGS:
        value = getattr(args, old, None)
        if value is None:
            continue
        flag = "--" + new.replace("_", "-")
        print(f"breakpod: --token is deprecated here: use {flag}", file=sys.stderr)
        if getattr(args, new, None) is None:
            setattr(args, new, value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breakpod", description="breakpoint() for pods.")
    parser.add_argument("--version", action="version", version=f"breakpod {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    add_attach(commands)
    add_run(commands)
    add_doctor(commands)
    add_sessions(commands)
    add_events(commands)
    add_send(commands)
    add_asks(commands)
    add_replay(commands)  # timetravel
    return parser


def add_attach(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "attach",
        help="attach to a parked process",
        description="Attach to a remote pdb (or print a VS Code config for a debugpy listener).",
    )
    p.add_argument(
        "target",
        metavar="HOST:PORT|SESSION_ID",
        nargs="?",
        help="listener address, e.g. 127.0.0.1:5678, or a session id known to the broker",
    )
    p.add_argument(
        "--pid",
        type=int,
        help="a running process with no breakpod in it (Python 3.14+: sys.remote_exec)",
    )
    p.add_argument(
        "--listener-token",
        help=f"the listener's token, when it requires one (default: ${LISTENER_TOKEN_ENV})",
    )
    p.add_argument("--token", dest="old_listener_token", help="deprecated: --listener-token")
    p.add_argument(
        "--vscode",
        action="store_true",
        help="print a launch.json for a debugpy listener instead of attaching",
    )
    p.add_argument(
        "--remote-root",
        help="source root inside the container, for pathMappings "
        "(default: the session's working directory, else .)",
    )
    p.add_argument(
        "--local-root",
        default="${workspaceFolder}",
        help="matching local source root (default: ${workspaceFolder})",
    )
    p.add_argument("--rank", type=int, help="with a JOB as target: attach to this rank of the job")
    p.add_argument("--broker", metavar="URL", help="broker URL (default: $BREAKPOD_BROKER_URL)")
    p.add_argument("--broker-token", help=f"the CLI's broker token (default: ${BROKER_TOKEN_ENV})")
    p.set_defaults(func=run_attach)


def run_attach(args: argparse.Namespace) -> int:
    from breakpod._cli import attach, remote_exec
    from breakpod._core import net

    if args.pid is not None:
        return remote_exec.attach_pid(args.pid, token=args.listener_token)
    if not args.target:
        raise BreakpodError("attach: give HOST:PORT, a SESSION_ID, or --pid PID")

    if args.rank is not None or (":" not in args.target and not args.target.isdigit()):
        from breakpod._cli.broker import attach_session

        return attach_session(args)
    host, port = net.parse_address(args.target)
    if args.vscode:  # the job's directory: the debugpy listener's own on this machine, else .
        remote_root = args.remote_root or attach.listener_cwd(host, port) or "."
        print(attach.vscode_launch(host, port, remote_root, args.local_root))
        return 0
    attach.attach(host, port, token=args.listener_token, remote_root=args.remote_root)
    return 0


def add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "run",
        help="run a program with breakpoint(), post-mortem and debug switches on",
        description="Run a program (e.g. python train.py) with breakpod's debug environment: "
        "breakpoint() parks on a socket when headless, an uncaught exception opens a "
        "post-mortem, torch.compile is off. Signals are forwarded; the exit status is the "
        "program's (128+N when killed by signal N).",
    )
    p.add_argument("--hold", metavar="SECONDS", help="how long a park waits for a debugger")
    p.add_argument("--port", metavar="PORT", help="listener port (+ LOCAL_RANK; 0 = any free)")
    p.add_argument("--host", help="listener address (default 127.0.0.1)")
    p.add_argument("--broker", metavar="URL", help="broker to register sessions with")
    p.add_argument("--backend", choices=BACKENDS, help="debugger backend")
    p.add_argument("--keep-compile", action="store_true", help="leave torch.compile enabled")
    p.add_argument(
        "command",  # argparse's name for the program to run
        nargs=argparse.REMAINDER,
        help="-- PROGRAM [ARGS...]",
    )
    p.set_defaults(func=run_run)


def run_run(args: argparse.Namespace) -> int:
    import os

    from breakpod._cli import runner

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = runner.debug_env(
        os.environ,
        hold=args.hold,
        port=args.port,
        host=args.host,
        broker=args.broker,
        backend=args.backend,
        keep_compile=args.keep_compile,
    )
    return runner.run(command, env)


def add_doctor(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "doctor",
        help="check that a debugger can reach this environment",
        description="Check this environment, one line per check with a fix: TTY and what "
        "breakpoint() will do, PYTHONBREAKPOINT, debugpy, bind address and port, broker, "
        "torch/CUDA/torch.compile, Kubernetes/Docker/CI. Exits 1 when attaching is blocked.",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from breakpod._cli import doctor

    checks = doctor.diagnose()
    print(doctor.to_json(checks) if args.json else doctor.render(checks))
    return doctor.exit_status(checks)


def add_sessions(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from breakpod._cli import broker as broker_cli

    p = commands.add_parser("sessions", help="list the sessions the broker knows")
    p.add_argument(
        "--state",
        choices=(*protocol.STATES, protocol.LOST),
        help="only sessions in this state",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--job", help="only the ranks of this job")
    broker_cli.add_broker_flags(p)
    p.set_defaults(func=broker_cli.run_sessions)


def add_events(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from breakpod._cli import broker as broker_cli

    p = commands.add_parser("events", help="show (or --follow) events from the broker")
    p.add_argument("--follow", "-f", action="store_true", help="stream new events until Ctrl-C")
    p.add_argument("--session", help="only this session's events")
    p.add_argument("--job", help="only the events of this job's sessions (every rank)")
    p.add_argument("--kind", action="append", help="only this kind (repeatable)")
    p.add_argument("--limit", type=int, default=50, help="how many recent events (default 50)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="one JSON object per line, whole")
    shown.add_argument(
        "--full", action="store_true", help="every field whole (stacks and tables below the line)"
    )
    broker_cli.add_broker_flags(p)
    p.set_defaults(func=broker_cli.run_events)


def add_send(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from breakpod._cli import broker as broker_cli

    p = commands.add_parser(
        "send",
        help="send a command to a session's agent, or to every rank of a job",
        description="A JOB (its id in `breakpod sessions`) gets the command on every live rank: "
        "`break` parks them all at one step boundary, `resume` continues them all.",
    )
    p.add_argument("session", metavar="SESSION_ID|JOB")
    p.add_argument("command", choices=protocol.COMMANDS)  # argparse's name
    p.add_argument("--reason", help="recorded with the command")
    broker_cli.add_broker_flags(p)
    p.set_defaults(func=broker_cli.run_send)


def add_asks(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands that ask each rank's agent for something through the broker."""
    from breakpod._cli import broker as broker_cli

    asks = (
        (
            "stacks",
            broker_cli.run_stacks,
            "print the current stacks of a session, or of every rank of a job",
            "Ask the agent(s) through the broker for every thread's Python stack.",
        ),
        (
            "flight",
            broker_cli.run_flight,
            "print the flight recorder of a session, or of every rank of a job",
            "Ask the agent(s) through the broker for the last steps of every watched module: "
            "where each first went non-finite or out of range, and the trend before. A session "
            "that has ended shows the dump its last anomaly or stall event carried.",
        ),
    )
    for name, func, help_, description in asks:
        p = commands.add_parser(name, help=help_, description=description)
        p.add_argument("target", metavar="SESSION_ID|JOB", nargs="?" if name == "stacks" else None)
        p.add_argument(
            "--timeout", type=_seconds, default=30.0, help="seconds to wait for each rank"
        )
        broker_cli.add_broker_flags(p)
        p.set_defaults(func=func)
        if name == "stacks":
            add_stacks_from_outside(p)


def add_stacks_from_outside(p: argparse.ArgumentParser) -> None:
    """``stacks --pid``, ``pod/NAME``, ``job/NAME``, ``compose:SERVICE``, ``container:ID``:
    read with py-spy, no breakpod in the job (docs/stacks.md)."""
    p.description = (
        f"{p.description} Or read a job that never imported breakpod with py-spy: "
        "--pid PID... (a launcher's PID finds its ranks), pod/NAME, job/NAME (Job, JobSet, "
        "PyTorchJob), compose:SERVICE, container:ID."
    )
    p.add_argument("--pid", type=int, nargs="+", default=[], help="processes (or a launcher)")
    p.add_argument("--native", action="store_true", help="with C/C++ frames (slower)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("-n", "--namespace", help="the pods' namespace (default: kubectl's)")
    p.add_argument("-c", "--container", help="the container the job runs in")
    p.add_argument("--image", help="an image with python3 and py-spy, for a debug container")
    p.add_argument(
        "--via",
        choices=("auto", "exec", "debug"),
        default="auto",
        help="exec into the job's container, or start a debug one with --image "
        "(auto: exec when its image has py-spy)",
    )
    p.set_defaults(func=run_stacks)


def run_stacks(args: argparse.Namespace) -> int:
    from breakpod._cli import broker as broker_cli
    from breakpod._cli import stacks

    if stacks.wanted(args):
        return stacks.run(args)
    if not args.target:
        raise BreakpodError("stacks: give a SESSION_ID or JOB, --pid PID..., or pod/NAME")
    return broker_cli.run_stacks(args)


def add_replay(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "replay",
        help="replay a step saved with 'replay save' and name its first non-finite op",
        description="Build the model with FACTORY (module:function, called with no "
        "arguments), load the bundle's weights, RNG and inputs, and re-run the step op by op.",
    )
    p.add_argument("bundle", help="the file written by 'replay save PATH' at a park")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY")
    p.add_argument(
        "--trust",
        action="store_true",
        help="load a bundle whose inputs hold objects other than tensors and containers "
        "(unpickling them runs code the file chooses: only for files you trust)",
    )
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    import importlib

    from breakpod._monitor.timetravel import replay

    module, _, name = args.model.partition(":")
    if not module or not name:
        raise replay.ReplayError(f"--model {args.model!r}: expected module:factory, e.g. train:Net")
    sys.path.insert(0, "")  # the current folder, as `python -m` would
    try:
        factory = getattr(importlib.import_module(module), name)
        model = factory()
    except Exception as e:  # the user's module: anything may go wrong in it
        raise replay.ReplayError(f"--model {args.model}: {type(e).__name__}: {e}") from e
    report = replay.replay_bundle(args.bundle, model, trusted=args.trust)
    print("\n".join(report.lines()))
    return 0 if report.reproduced is not False else 1


def _seconds(raw: str) -> float:
    """A positive, finite number of seconds (argparse says what was wrong otherwise)."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a positive number of seconds")
    return value


if __name__ == "__main__":
    sys.exit(main())
