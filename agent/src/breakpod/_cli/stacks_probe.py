"""Find a job's rank processes and dump each one's stacks with py-spy; JSON out.

Standard library only and importing nothing of breakpod: ``breakpod stacks`` runs
this file, packed into ``python3 -c``, inside a pod or a container,
where breakpod is not installed, as well as here.

A PID given is a rank when its environment holds ``RANK`` (torchrun,
``accelerate launch``, deepspeed) or ``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``
(mpirun); otherwise it is a launcher, and its descendants that are ranks are
dumped (not their children, DataLoader workers, which inherit ``RANK``); when
none is, a Python process is dumped itself (its children may be DataLoader
workers), any other parent (a shell, a wrapper) its Python descendants.
Each dump is py-spy's ``dump --json`` with a timeout of its own, in parallel.
py-spy pauses the process while it reads (its default): a consistent stack for
the few milliseconds it takes (see docs/stacks.md for the numbers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
LOCAL_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
CAP_SYS_PTRACE = 19
PTRACE_FIX = {
    "1": "kernel.yama.ptrace_scope is 1 (only a parent may trace): run as root, "
    "give py-spy CAP_SYS_PTRACE, or set sysctl kernel.yama.ptrace_scope=0",
    "2": "kernel.yama.ptrace_scope is 2 (only CAP_SYS_PTRACE may trace): run as root "
    "or add the SYS_PTRACE capability (docker --cap-add SYS_PTRACE; "
    "securityContext.capabilities.add: [SYS_PTRACE])",
    "3": "kernel.yama.ptrace_scope is 3 (no process may be traced until reboot): "
    "nothing on this node can read the stacks",
}


def proc(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def environ(pid: int) -> dict[str, str]:
    try:
        raw = proc(pid, "environ")
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = proc(int(entry), "stat").decode(errors="replace")
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int, kids: dict[int, list[int]]) -> list[int]:
    found, todo = [], list(kids.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += kids.get(child, [])
    return found


def first(env: dict[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return exe.startswith(("python", "pypy"))


def targets(pids: list[int]) -> list[tuple[int, int | None]]:
    """(pid, the launcher it was found under) for every process to dump."""
    kids = children_map()
    parents = {kid: parent for parent, children in kids.items() for kid in children}
    out: list[tuple[int, int | None]] = []
    for pid in pids:
        below = descendants(pid, kids)
        if first(environ(pid), RANK_VARS) is not None or not below:
            out.append((pid, None))
            continue
        ranked = {p for p in below if first(environ(p), RANK_VARS) is not None}
        # a rank's children (DataLoader workers) inherit RANK: only the topmost are ranks
        ranks = [p for p in below if p in ranked and parents.get(p) not in ranked]
        if not ranks and not is_python(pid):  # a shell or a wrapper: its Python programs
            ranks = [p for p in below if is_python(p)]
        ranks = ranks or [pid]  # a Python program with workers (a DataLoader's): itself
        out += [(p, None if p == pid else pid) for p in ranks]
    return out


def describe(pid: int, launcher: int | None) -> dict[str, Any]:
    env = environ(pid)
    try:
        cmdline = proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmdline = ""
    return {
        "pid": pid,
        "launcher": launcher,
        "rank": first(env, RANK_VARS),
        "local_rank": first(env, LOCAL_VARS),
        "world_size": first(env, WORLD_VARS),
        "cmdline": cmdline,
    }


def spy_path() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def dump(pid: int, native: bool, timeout: float) -> dict[str, Any]:
    """py-spy's threads of ``pid``, or ``error``: one line saying why not and what to do."""
    spy = spy_path()
    if spy is None:
        return {"error": "py-spy is not installed here: pip install 'breakpod[stacks]' (or py-spy)"}
    argv = [spy, "dump", "--json", "--pid", str(pid)] + (["--native"] if native else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"py-spy did not answer within {timeout:g}s (raise --timeout)"}
    if done.returncode == 0:
        try:
            return {"threads": json.loads(done.stdout)}
        except ValueError:
            return {"error": f"py-spy printed no JSON: {done.stdout.strip()[:200]}"}
    return {"error": why_not(pid, done.stderr)}


def why_not(pid: int, stderr: str) -> str:
    """py-spy's failure as one line that names the cause and the setting to change."""
    said = " ".join(stderr.strip().splitlines()[:1])
    if not os.path.exists(f"/proc/{pid}"):
        return f"no process {pid} (it ended, or it lives in another PID namespace)"
    low = stderr.lower()
    if "permission" in low or "not permitted" in low:
        return ptrace_refusal(pid)
    if "python" in low and ("find" in low or "version" in low or "interpreter" in low):
        return f"process {pid} is not a Python process py-spy can read ({said})"
    return f"py-spy failed on process {pid}: {said}"


def ptrace_refusal(pid: int) -> str:
    scope = read_text("/proc/sys/kernel/yama/ptrace_scope")
    if scope == "3" or (scope in PTRACE_FIX and not can_ptrace()):
        return f"ptrace of process {pid} refused: {PTRACE_FIX[scope]}"
    if not can_ptrace():
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            owner = -1
        if owner != os.getuid():
            return (
                f"ptrace of process {pid} refused: it belongs to uid {owner} and this is uid "
                f"{os.getuid()} without CAP_SYS_PTRACE: run as uid {owner} or as root"
            )
        return (
            f"ptrace of process {pid} refused: no CAP_SYS_PTRACE (in a container: "
            "--cap-add SYS_PTRACE, or securityContext.capabilities.add: [SYS_PTRACE])"
        )
    return (
        f"ptrace of process {pid} refused although this process may trace: a seccomp "
        "profile or an LSM blocks it (docker: --security-opt seccomp=unconfined)"
    )


def can_ptrace() -> bool:
    for line in read_text("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    return False


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def probe(pids: list[int], native: bool = False, timeout: float = 10.0) -> list[dict[str, Any]]:
    found = targets(pids)
    with ThreadPoolExecutor(max_workers=min(32, len(found) or 1)) as pool:
        return list(pool.map(lambda t: {**describe(*t), **dump(t[0], native, timeout)}, found))


def main(argv: list[str]) -> int:
    """``[--native] [--timeout S] PID...``: the processes as a JSON list on stdout."""
    native = "--native" in argv
    argv = [a for a in argv if a != "--native"]
    timeout = 10.0
    if "--timeout" in argv:
        at = argv.index("--timeout")
        timeout = float(argv[at + 1])
        del argv[at : at + 2]
    print(json.dumps(probe([int(a) for a in argv], native, timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
