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
import shutil
import time
from collections.abc import Sequence
from typing import Any

from breakpod._cli import stacks_kube
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
    places = [[LOCAL]] if args.pid else resolve(args)
    pids = list(args.pid) or [1]  # in a pod or a container: from its first process
    if args.dry_run:
        print("\n".join(dry_run(places, pids, args)))
        return 0
    started = time.monotonic()
    hosts = [choose(candidates) for candidates in places]
    processes = [p for host in hosts for p in read(host, pids, args.native, args.timeout)]
    if args.json:
        print(json.dumps(report.to_json(processes), indent=2))
    else:
        text, _ = report.report(processes, heading(processes, time.monotonic() - started))
        print(text)
    return 0 if any(p.threads for p in processes) else 1


def dry_run(places: list[list[Host]], pids: list[int], args: argparse.Namespace) -> list[str]:
    """Each command that would run; where two may, the check that picks one, commented."""
    lines = []
    for candidates in places:
        if len(candidates) > 1:
            lines.append(
                f"# {candidates[0].label}: the first when its image has py-spy, else the second"
            )
        lines += [shlex.join(h.argv(pids, args.native, args.timeout)) for h in candidates]
    return lines


def choose(candidates: list[Host]) -> Host:
    """The first place, or the debug container when the job's image has no py-spy."""
    if len(candidates) == 1 or remote.spy_in_image(candidates[0]):
        return candidates[0]
    return candidates[1]


def resolve(args: argparse.Namespace) -> list[list[Host]]:
    """For each pod or container the target names: where to run the probe, in order."""
    kind, _, name = args.target.replace(":", "/", 1).partition("/")
    if kind == "container":
        return [docker_hosts(name, args)]
    if kind == "compose":  # the target's prefix, compose:SERVICE
        return [docker_hosts(c, args) for c in remote.compose_containers(name)]
    if kind == "pod":
        return [pod_hosts(name, args.container, args)]
    if through_client(args):
        api = stacks_kube.core_api()
        pods = stacks_kube.job_pods(api, name, stacks_kube.namespace(args.namespace))
    else:
        pods = remote.job_pods(name, args.namespace)
    return [pod_hosts(p["metadata"]["name"], first_container(p, args), args) for p in pods]


def through_client(args: argparse.Namespace) -> bool:
    """No kubectl here (a pod of the cluster): the kubernetes client makes the calls."""
    return shutil.which("kubectl") is None and not args.dry_run


def first_container(pod: dict[str, Any], args: argparse.Namespace) -> str:
    return str(args.container or pod["spec"]["containers"][0]["name"])


def pod_hosts(pod: str, container: str | None, args: argparse.Namespace) -> list[Host]:
    hosts = [remote.kubectl_exec(pod, args.namespace, container)]
    if args.via != "exec" and args.image:
        if container is None:
            raise StacksError(f"pod/{pod}: a debug container needs --container (its target)")
        hosts.append(remote.kubectl_debug(pod, args.namespace, container, args.image))
    elif args.via == "debug":
        raise StacksError("--via debug needs --image: an image with python3 and py-spy")
    hosts = hosts[-1:] if args.via == "debug" else hosts
    return [with_client(h, pod, container, args) for h in hosts] if through_client(args) else hosts


def with_client(host: Host, pod: str, container: str | None, args: argparse.Namespace) -> Host:
    """The same host, its commands made through the kubernetes client's exec or
    ephemeral container instead of kubectl's."""
    api, ns = stacks_kube.core_api(), stacks_kube.namespace(args.namespace)
    if host.prefix[1] == "debug":
        runner = stacks_kube.debug_probe(api, pod, ns, str(container), args.image, args.timeout)
    else:
        runner = stacks_kube.exec_probe(api, pod, ns, container, args.timeout)
    return dataclasses.replace(host, client=runner)


def docker_hosts(container: str, args: argparse.Namespace) -> list[Host]:
    hosts = [remote.docker_exec(container)]
    if args.via != "exec" and args.image:
        hosts.append(remote.docker_run(container, args.image))
    elif args.via == "debug":
        raise StacksError("--via debug needs --image: an image with python3 and py-spy")
    return hosts[-1:] if args.via == "debug" else hosts


def read(host: Host, pids: Sequence[int], native: bool, timeout: float) -> list[report.Process]:
    """The processes under ``pids`` on ``host``; of the ranks in backward, one per place
    is read again with native frames, and what it waits in holds for its place."""
    processes = [process(r) for r in remote.collect(host, pids, native, timeout)]
    if native:
        return processes
    places: dict[str, list[report.Process]] = {}
    for p in processes:
        where = report.place(p)
        if where.state == report.BACKWARD:
            places.setdefault(where.frame, []).append(p)
    if not places:
        return processes
    firsts = [members[0].pid for members in places.values()]
    deeper = {r["pid"]: r for r in remote.collect(host, firsts, True, timeout)}
    found = {}
    for members in places.values():
        found.update(_seen_natively(members, deeper.get(members[0].pid)))
    return [found.get(p.pid, p) for p in processes]


def _seen_natively(
    members: list[report.Process], record: dict[str, Any] | None
) -> dict[int, report.Process]:
    """The first member read natively, and what it waits in told to the others."""
    if record is None or "threads" not in record:
        return {}
    first = dataclasses.replace(process(record), launcher=members[0].launcher)
    thread = report.main_thread(first.threads)
    op = report.collective_op(thread.frames) if thread else ""
    rest = {p.pid: dataclasses.replace(p, seen_natively=op) for p in members[1:] if op}
    return {first.pid: first, **rest}


NO_SPY = "py-spy is not installed here"


def process(record: dict[str, Any]) -> report.Process:
    error, host = record.get("error"), record.get("host", "")
    if host and error and error.startswith(NO_SPY):  # the job's image: say how else
        error = f"no py-spy in {host}'s image: pass --image IMAGE (python3 and py-spy)"
    return report.Process(
        pid=record["pid"],
        threads=thread_stacks.from_pyspy(record.get("threads") or []),
        rank=record.get("rank"),
        local_rank=record.get("local_rank"),
        world_size=record.get("world_size"),
        launcher=record.get("launcher"),
        error=error,
        host=host,
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
