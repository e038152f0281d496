"""The broker side of the ``breakpod`` CLI: sessions, events, send, attach SESSION_ID."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from breakpod import protocol
from breakpod._cli import stacks_report
from breakpod._core import net
from breakpod._core.config import token_value
from breakpod._core.errors import AttachError, BrokerRequestError
from breakpod._link.client import ENV_TOKEN, ENV_URL, BrokerClient
from breakpod._monitor.flight import table as flight_table

PORT_FORWARD_TIMEOUT = 15.0


def add_broker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", metavar="URL", help=f"broker URL (default: ${ENV_URL})")
    p.add_argument("--broker-token", help=f"the CLI's broker token (default: ${ENV_TOKEN})")
    p.add_argument("--token", dest="old_broker_token", help="deprecated: --broker-token")


def client(args: argparse.Namespace) -> BrokerClient:
    url = getattr(args, "broker", None) or os.environ.get(ENV_URL)
    if not url:
        raise BrokerRequestError(f"no broker given: pass --broker URL or set {ENV_URL}")
    return BrokerClient(url, args.broker_token or token_value(ENV_TOKEN))


def run_sessions(args: argparse.Namespace) -> int:
    job = getattr(args, "job", None)
    sessions = client(args).sessions(state=args.state, job=job)
    sessions = [s for s in sessions if not job or s.get("job") == job]  # older brokers
    if args.json:
        print(json.dumps(sessions, indent=2))
        return 0
    sessions.sort(key=lambda s: (s.get("job") or "", s.get("rank") or 0))  # a job's ranks together
    rows = [["ID", "JOB", "POD/HOST", "RANK", "STATE", "STEP", "REASON", "AGE"]]
    furthest = furthest_steps(sessions)
    rows += [_session_row(s, furthest.get(s.get("job") or "")) for s in sessions]
    print(_table(rows))
    for line in job_lines(sessions):
        print(line)
    return 0


def job_lines(sessions: list[dict[str, Any]]) -> list[str]:
    """One line per job of several ranks with each rank's state."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        if s.get("job") and s.get("rank") is not None:
            jobs.setdefault(s["job"], []).append(s)
    return [
        f"job {job}: " + ", ".join(f"rank {s['rank']} {s['state']}" for s in ranks)
        for job, ranks in jobs.items()
        if len(ranks) > 1
    ]


def run_stacks(args: argparse.Namespace) -> int:
    """``breakpod stacks SESSION|JOB``: every thread's stack of one rank or of each rank."""
    broker = client(args)
    sessions = job_sessions(broker.sessions(), args.target)
    answers = [_ask(broker, s, protocol.DUMP_STACKS, args.timeout) for s in sessions]
    print(stacks_report.agent_summary(sessions, answers, args.timeout), flush=True)
    for session, answer in zip(sessions, answers, strict=True):
        print(_heading(session), flush=True)
        print(answer if answer is not None else _no_answer(args.timeout), flush=True)
    return 0


def run_flight(args: argparse.Namespace) -> int:
    """``breakpod flight SESSION|JOB``: the flight recorder of one rank or of each rank,
    asked for now; a process that is gone shows the dump its last event carried."""
    broker = client(args)
    for session in job_sessions(broker.sessions(), args.target):
        print(_heading(session), flush=True)
        live = session["state"] not in (protocol.LOST, *protocol.FINAL_STATES)
        answer = _ask(broker, session, protocol.DUMP_FLIGHT, args.timeout) if live else None
        if answer is None and live:
            print(_no_answer(args.timeout), flush=True)
        print(answer if answer is not None else _recorded_flight(broker, session), flush=True)
    return 0


def _heading(session: dict[str, Any]) -> str:
    rank = "" if session.get("rank") is None else f"rank {session['rank']} "
    return f"=== {rank}{session['id']} ==="


def _ask(broker: BrokerClient, session: dict[str, Any], command: str, timeout: float) -> str | None:
    command_id = broker.send_command(session["id"], {"command": command, "reason": "breakpod CLI"})
    return _await_ack(broker, session["id"], command_id, timeout)


def _recorded_flight(broker: BrokerClient, session: dict[str, Any]) -> str:
    """The newest flight dump an event of the session carried."""
    for event in reversed(broker.events(session=session["id"], limit=1000)):
        dump = event.get("fields", {}).get(protocol.FLIGHT_FIELD)
        if isinstance(dump, dict):
            kind = event.get("kind", "event")
            return "\n".join([f"(from its last {kind} event)", *flight_table.lines(dump)])
    return f"no flight recorder dump: none of session {session['id']}'s events carried one"


def job_sessions(sessions: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """The session named ``target``, else the live ranks of the job named ``target``."""
    exact = [s for s in sessions if s["id"] == target]
    if exact:
        return exact
    live = [
        s
        for s in sessions
        if s.get("job") == target and s["state"] not in (protocol.LOST, *protocol.FINAL_STATES)
    ]
    if not live:
        jobs = sorted({s["job"] for s in sessions if s.get("job")})
        if target in jobs:  # known, but none of its ranks runs
            raise BrokerRequestError(
                f"job {target!r} has no running rank (its sessions are finished or lost): "
                f"see breakpod sessions --job {target}"
            )
        raise BrokerRequestError(
            f"no session or running job {target!r}; jobs the broker knows: {', '.join(jobs) or '-'}"
        )
    return sorted(live, key=lambda s: s.get("rank") or 0)


def _await_ack(broker: BrokerClient, session: str, command_id: str, timeout: float) -> str | None:
    """The agent's answer to a command, or None when none came within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in broker.events(session=session, kind=protocol.COMMAND_KIND, limit=100):
            fields = event.get("fields", {})
            ended = fields.get("state") in protocol.COMMAND_ENDED
            if fields.get("command_id") == command_id and ended:
                return str(fields.get("detail") or fields["state"])
        time.sleep(0.25)
    return None


def _no_answer(timeout: float) -> str:
    return f"(no answer within {timeout:g}s: is the process alive and polling the broker?)"


def _session_row(s: dict[str, Any], furthest: int | None = None) -> list[str]:
    where = f"{s['namespace']}/{s['pod']}" if s.get("pod") and s.get("namespace") else s.get("host")
    rank = "-" if s.get("rank") is None else f"{s['rank']}/{s.get('world_size') or '?'}"
    reason = incident(s)[:100]
    return [
        s["id"],
        s.get("job") or "-",
        where or "-",
        rank,
        s["state"],
        step_cell(s, furthest),
        reason,
        _age(s["created"]),
    ]


def _live_step(s: dict[str, Any]) -> int | None:
    """The last step its heartbeat carried, for a session that has not ended."""
    step = s.get("step")
    ended = s.get("state") in (protocol.LOST, *protocol.FINAL_STATES)
    return step if isinstance(step, int) and not isinstance(step, bool) and not ended else None


def furthest_steps(sessions: list[dict[str, Any]]) -> dict[str, int]:
    """Each job's furthest live rank's step."""
    furthest: dict[str, int] = {}
    for s in sessions:
        step = _live_step(s)
        if s.get("job") and step is not None:
            furthest[s["job"]] = max(step, furthest.get(s["job"], step))
    return furthest


def step_cell(s: dict[str, Any], furthest: int | None) -> str:
    """The STEP column: the session's last step and, behind its job's furthest, by how
    much (a straggler shows before it stalls), as the dashboard's job card says."""
    step = _live_step(s)
    if step is None:
        return "-"
    behind = (furthest or step) - step
    return f"{step} ({behind} behind)" if behind > 0 else str(step)


def incident(s: dict[str, Any], now: float | None = None) -> str:
    """The REASON column: what the dashboard's job card says of the session. A stall
    names the culprit rank(s) the job waits for, where, and for how long; a park its
    reason and how long it still holds; an attached session who is attached."""
    now = time.time() if now is None else now
    state, reason = s.get("state"), s.get("reason") or ""
    since = s.get("since")
    if state == protocol.STATE_OF_KIND[protocol.STALL] and s.get("culprit"):
        reason = f"culprit {s['culprit']}"
    if state == protocol.STATE_OF_KIND[protocol.STALL] and isinstance(since, (int, float)):
        reason += f"; for {_age(since, now)}"
    hold = s.get("hold_until")
    if state == protocol.STATE_OF_KIND[protocol.PARKED] and isinstance(hold, (int, float)):
        reason += f"; holds {_duration(max(0, int(hold - now)))} more"
    if state == protocol.STATE_OF_KIND[protocol.ATTACHED] and s.get("attached_by"):
        reason += f"; attached: {s['attached_by']}"
    return reason.lstrip("; ")


def _age(since: float, now: float | None = None) -> str:
    return _duration(max(0, int((time.time() if now is None else now) - since)))


def _duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def run_events(args: argparse.Namespace) -> int:
    broker = client(args)
    found: Iterator[dict[str, Any]]
    job = getattr(args, "job", None)
    if job:
        found = job_events(broker, job, args)
    elif args.follow:
        found = (event for _, event in broker.event_stream(session=args.session, kind=args.kind))
    else:
        found = iter(broker.events(limit=args.limit, session=args.session, kind=args.kind))
    show = json.dumps if args.json else (full_event if args.full else format_event)
    for event in found:
        print(show(event), flush=True)
    return 0


def job_events(
    broker: BrokerClient, job: str, args: argparse.Namespace
) -> Iterator[dict[str, Any]]:
    """``events --job JOB``: the events of every session (rank) of the job, oldest first,
    the last ``--limit`` of them together; with ``--follow``, new ones as they come
    (a session that joins the job later is picked up at its first event)."""
    ids = {s["id"] for s in broker.sessions(job=job) if s.get("job") == job}
    if not ids and not args.follow:
        raise BrokerRequestError(f"no session of job {job!r} at the broker (see breakpod sessions)")
    if args.follow:
        return _follow_job(broker, job, ids, args.kind)
    found = [
        e for s in sorted(ids) for e in broker.events(limit=args.limit, session=s, kind=args.kind)
    ]
    found.sort(key=lambda e: (e.get("time", 0), e.get("cursor") or ""))
    return iter(found[-args.limit :])


def _follow_job(
    broker: BrokerClient, job: str, ids: set[str], kind: list[str] | None
) -> Iterator[dict[str, Any]]:
    others: set[str] = set()  # sessions seen that are not the job's
    for _, event in broker.event_stream(kind=kind):
        session = str(event.get("session"))
        if session not in ids and session not in others:
            ids |= {s["id"] for s in broker.sessions(job=job) if s.get("job") == job}
            others |= {session} - ids
        if session in ids:
            yield event


def format_event(event: dict[str, Any]) -> str:
    """One line: the time, kind, session and each field (long ones cut at 80 characters)."""
    fields = " ".join(
        f"{k}={_short(v)}" for k, v in event.get("fields", {}).items() if v is not None
    )
    return f"{_head(event)}  {fields}".rstrip()


def full_event(event: dict[str, Any]) -> str:
    """The line with the short fields, then each long or multi-line one whole, indented."""
    short: list[tuple[str, Any, str]] = []
    long: list[tuple[str, Any, str]] = []
    for key, value in event.get("fields", {}).items():
        if value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        (long if "\n" in text or len(text) > 80 else short).append((key, value, text))
    lines = [f"{_head(event)}  " + " ".join(f"{k}={t}" for k, _, t in short)]
    for key, value, text in long:
        if not isinstance(value, str):
            text = json.dumps(value, indent=2, default=str)
        lines.append(f"  {key}:")
        lines.extend("    " + line for line in text.splitlines())
    return "\n".join(line.rstrip() for line in lines)


def _head(event: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
    return f"{stamp}  {event['kind']:<9} {event['session']}"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n")
    return text if len(text) <= 80 else text[:77] + "..."


def run_send(args: argparse.Namespace) -> int:
    """``breakpod send SESSION|JOB COMMAND``: to one session, or to every live rank of a job
    (a job's ranks agree among themselves on the step a ``break`` parks them at): one
    job-wide command per namespace the job runs in, which each of its ranks receives."""
    broker = client(args)
    body = {"command": args.command, "reason": args.reason}
    if _is_session(broker, args.session):
        command_id = broker.send_command(args.session, body)
        print(f"queued {args.command} for {args.session} (command {command_id})")
        return 0
    ranks = _job_ranks(broker, args.session)
    for namespace in sorted({s.get("namespace") or "" for s in ranks}):
        command_id = broker.send_job_command(args.session, namespace or None, body)
        for s in ranks:
            if (s.get("namespace") or "") == namespace:
                print(f"queued {args.command} for {s['id']} (job command {command_id})")
    return 0


def _job_ranks(broker: BrokerClient, job: str) -> list[dict[str, Any]]:
    """The job's live ranks, listed by the broker's job filter; when there are none,
    the error names the jobs the whole listing knows."""
    try:
        return job_sessions(broker.sessions(job=job), job)
    except BrokerRequestError:
        return job_sessions(broker.sessions(), job)


def _is_session(broker: BrokerClient, target: str) -> bool:
    try:
        broker.session(target)
    except BrokerRequestError:
        return False
    return True


def rank_session(sessions: list[dict[str, Any]], job: str, rank: int) -> str:
    """The session id of ``rank`` of ``job``; a one-line error naming the job's ranks."""
    ranks = job_sessions(sessions, job)
    for s in ranks:
        if s.get("rank") == rank:
            return str(s["id"])
    ranked = sorted(s["rank"] for s in ranks if s.get("rank") is not None)
    if not ranked:
        ids = ", ".join(s["id"] for s in ranks)
        raise BrokerRequestError(
            f"job {job!r} has no ranks (its processes set no RANK): attach without --rank, "
            f"by the job or by session id ({ids})"
        )
    known = ", ".join(map(str, ranked))
    raise BrokerRequestError(f"job {job!r} has no rank {rank}; its ranks: {known}")


def resolve_attach_target(sessions: list[dict[str, Any]], target: str) -> str:
    """The session to attach to for ``target``: a session id, or a job of one live
    process; a job of several names its ranks (``--rank N``)."""
    if any(s["id"] == target for s in sessions):
        return target
    live = job_sessions(sessions, target)  # says which jobs exist when there is none
    if len(live) == 1:
        return str(live[0]["id"])
    ranks = ", ".join(str(s.get("rank", "-")) for s in live)
    raise AttachError(
        f"job {target!r} has {len(live)} live processes (ranks {ranks}): "
        f"pick one with --rank N, or attach by session id"
    )


def attach_session(args: argparse.Namespace) -> int:
    """``breakpod attach SESSION_ID``: resolve it through the broker, then attach."""
    from breakpod._cli import attach

    broker = client(args)
    sessions = broker.sessions()
    if getattr(args, "rank", None) is not None:
        target = rank_session(sessions, args.target, args.rank)
    else:
        target = resolve_attach_target(sessions, args.target)
    info = broker.attach_info(target, _free_port())
    _check_attachable(target, info)
    host, port = net.parse_address(info["connect"])
    remote_root = args.remote_root or info.get("cwd") or "."
    if args.vscode or info["listener"] == protocol.DAP_LISTENER:
        launch = protocol.vscode_launch(
            target, host, port, local_root=args.local_root, remote_root=remote_root
        )
        if info.get("port_forward"):
            print(f"// first run: {info['port_forward']}", file=sys.stderr)
        print(json.dumps(launch, indent=2))
        if not args.vscode:  # as by address: a debugpy listener is no terminal's (exit 2)
            raise AttachError(attach.dap_listener_message(f"session {target}"))
        return 0
    forward = info.get("port_forward")
    with PortForward(port_forward_argv(info), port) if forward else contextlib.nullcontext():
        attach.attach(host, port, token=args.listener_token, remote_root=remote_root)
    return 0


def _check_attachable(target: str, info: dict[str, Any]) -> None:
    """A finished or lost session has nothing listening: say so, exit non-zero."""
    if info.get("state") in (protocol.LOST, *protocol.FINAL_STATES):
        raise AttachError(
            f"session {target} is {info['state']}: nothing listens any more "
            "(`breakpod sessions` lists the live ones)"
        )


def port_forward_argv(info: dict[str, Any]) -> list[str]:
    """The broker's ``kubectl port-forward`` argv, run without a shell and only in
    its one expected shape: a session's pod and namespace come from the pod itself,
    and must not smuggle options (``--server=...``) into the engineer's kubectl."""
    argv = info.get("port_forward_argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise AttachError(
            "the broker sent no port_forward_argv (it is older than this CLI: upgrade it); "
            "breakpod never runs the display string port_forward"
        )
    shape = argv[:3] == ["kubectl", "port-forward", "-n"] and len(argv) == 6
    if not shape or any(a.startswith("-") for a in argv[3:]) or not argv[4].startswith("pod/"):
        raise AttachError(f"refusing an unexpected port-forward command from the broker: {argv}")
    return argv


class PortForward:
    """Runs ``kubectl port-forward`` until the block ends; waits for the local port."""

    def __init__(self, argv: list[str], local_port: int) -> None:
        self.argv = list(argv)
        self.local_port = local_port
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PortForward:
        print(f"breakpod: {shlex.join(self.argv)}", file=sys.stderr)
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
            )
        except OSError as e:
            raise AttachError(
                f"cannot run {self.argv[0]!r} ({e.strerror}): is kubectl installed?"
            ) from e
        self._wait_for_port()
        return self

    def _wait_for_port(self) -> None:
        """kubectl prints "Forwarding from 127.0.0.1:PORT -> ..." once it listens. (A test
        connection would reach the parked process and count as an attach.)"""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + PORT_FORWARD_TIMEOUT
        seen = b""
        while time.monotonic() < deadline and b"Forwarding from" not in seen:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            chunk = os.read(self.proc.stdout.fileno(), 4096) if ready else b""
            if ready and not chunk:
                raise AttachError(f"kubectl port-forward failed: {seen.decode(errors='replace')}")
            seen += chunk
        if b"Forwarding from" not in seen:
            self.__exit__()
            raise AttachError(f"kubectl port-forward did not start in {PORT_FORWARD_TIMEOUT:g}s")

    def __exit__(self, *_exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
