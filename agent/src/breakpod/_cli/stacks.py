"""``breakpod stacks --pid PID``, ``pod/NAME``, ``job/NAME``, ``compose:SERVICE``,
``container:ID``: the job report of processes that never imported breakpod.

The stacks are read with py-spy (see ``stacks_probe``); ranks whose main thread
sits in backward are read once more with native frames, since DDP's gradient
all_reduce waits there in C++ and only a native frame tells it from a slow
backward. A SESSION or JOB known to the broker goes to the agent instead
(``_cli/broker.run_stacks``); both print the report of ``stacks_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from collections.abc import Sequence
from typing import Any

from breakpod._cli import stacks_remote as remote
from breakpod._cli import stacks_report as report
from breakpod._cli.stacks_remote import Host, StacksError
from breakpod._job import thread_stacks

LOCAL = Host("")
REMOTE_PREFIXES = ("pod/", "job/", "compose:", "container:")


def wanted(args: argparse.Namespace) -> bool:
    """Whether this invocation is read from outside (else it asks the broker)."""
    return bool(args.pid) or str(args.target or "").startswith(REMOTE_PREFIXES)


def run(args: argparse.Namespace) -> int:
    if args.pid and args.target:
        raise StacksError("give either --pid PID... or a target, not both")
    hosts = [(LOCAL, list(args.pid))] if args.pid else resolve(args)
    if args.dry_run:
        for host, pids in hosts:
            print(shlex.join(host.argv(pids, args.native, args.timeout)))
        return 0
    started = time.monotonic()
    processes = [p for host, pids in hosts for p in read(host, pids, args.native, args.timeout)]
    if args.json:
        print(json.dumps(report.to_json(processes), indent=2))
    else:
        text, _ = report.report(processes, heading(processes, time.monotonic() - started))
        print(text)
    return 0 if any(p.threads for p in processes) else 1


def resolve(args: argparse.Namespace) -> list[tuple[Host, list[int]]]:
    """The hosts (pods, containers) named by the target, each with the PID to start from."""
    kind, _, name = args.target.replace(":", "/", 1).partition("/")
    if kind == "container":
        return [(docker_host(name, args), [1])]
    if kind == "compose":
        return [(docker_host(c, args), [1]) for c in remote.compose_containers(name)]
    if kind == "pod":
        return [(pod_host(name, args.container, args), [1])]
    pods = remote.job_pods(name, args.namespace)
    return [(pod_host(p["metadata"]["name"], first_container(p, args), args), [1]) for p in pods]


def first_container(pod: dict[str, Any], args: argparse.Namespace) -> str:
    return str(args.container or pod["spec"]["containers"][0]["name"])


def pod_host(pod: str, container: str | None, args: argparse.Namespace) -> Host:
    exec_host = remote.kubectl_exec(pod, args.namespace, container)
    if args.via == "exec" or (args.via == "auto" and not args.image):
        return exec_host
    if container is None:
        raise StacksError(f"pod/{pod}: an ephemeral container needs --container (its target)")
    debug_host = remote.kubectl_debug(pod, args.namespace, container, args.image)
    if args.via == "debug" or args.dry_run:
        return debug_host
    return exec_host if remote.spy_in_image(exec_host) else debug_host


def docker_host(container: str, args: argparse.Namespace) -> Host:
    exec_host = remote.docker_exec(container)
    if args.via == "exec" or (args.via == "auto" and not args.image):
        return exec_host
    run_host = remote.docker_run(container, args.image)
    if args.via == "debug" or args.dry_run:
        return run_host
    return exec_host if remote.spy_in_image(exec_host) else run_host


def read(host: Host, pids: Sequence[int], native: bool, timeout: float) -> list[report.Process]:
    """The processes under ``pids`` on ``host``; those in backward again with native frames."""
    processes = [process(r) for r in remote.collect(host, pids, native, timeout)]
    if native:
        return processes
    again = [p.pid for p in processes if report.place(p).state == report.BACKWARD]
    if again:
        deeper = {r["pid"]: r for r in remote.collect(host, again, True, timeout)}
        processes = [_deeper(p, deeper.get(p.pid)) for p in processes]
    return processes


def _deeper(first: report.Process, record: dict[str, Any] | None) -> report.Process:
    """The native read where it worked; the launcher is the first read's (a PID alone
    is read as itself)."""
    if record is None or "threads" not in record:
        return first
    return dataclasses.replace(process(record), launcher=first.launcher)


def process(record: dict[str, Any]) -> report.Process:
    return report.Process(
        pid=record["pid"],
        threads=thread_stacks.from_pyspy(record.get("threads") or []),
        rank=record.get("rank"),
        local_rank=record.get("local_rank"),
        world_size=record.get("world_size"),
        launcher=record.get("launcher"),
        error=record.get("error"),
        host=record.get("host", ""),
    )


def heading(processes: Sequence[report.Process], seconds: float) -> str:
    ranks = [p for p in processes if p.rank is not None]
    launchers = sorted({p.launcher for p in processes if p.launcher is not None})
    under = f" under launcher pid {','.join(map(str, launchers))}" if launchers else ""
    count = len(ranks) or len(processes)
    what = ("rank" if ranks else "process") + ("s" if count != 1 else "")
    if not ranks and count != 1:
        what = "processes"
    return f"stacks: {count} {what}{under}, read by py-spy in {seconds:.2f}s"
