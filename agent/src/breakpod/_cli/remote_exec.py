"""``breakpod attach --pid PID``: park a running process that was started without
breakpod, then attach to it.

Python 3.14's ``sys.remote_exec`` (PEP 768) runs a script in another 3.14
process's main thread at its next safe point (between two bytecodes, never inside a
C call). The script below imports breakpod from the job's own environment, starts a
remote pdb listener on a free 127.0.0.1 port, writes its address where this side
reads it, and parks in the frame it interrupted, as a ``breakpoint()`` there would.
This side then attaches as ``breakpod attach HOST:PORT`` does.

The script and its answer live in the job's ``/tmp`` as the job sees it
(``/proc/PID/root/tmp``: the same folder, or its container's), because
``sys.remote_exec`` opens the path inside the job.

What stops it, each said in one line: an interpreter before 3.14 here; a job that is
not 3.14, runs with ``-X disable_remote_debug``, or may not be traced by this user;
a job that cannot import breakpod; a main thread waiting in native code (a
collective) that reaches no safe point in time: ``breakpod stacks --pid`` reads it
where it is.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from breakpod import protocol
from breakpod._cli import attach
from breakpod._core import net
from breakpod._core.errors import AttachError

Inject = Callable[[int, str], None]  # (pid, script path inside the job): sys.remote_exec

# Runs inside the job. Its frame's caller is the frame it interrupted; whatever fails
# is written back as text and never raised into the job.
INJECTED = """\
import json as _json, os as _os, sys as _sys
try:
    import breakpod as _breakpod
    _end = _breakpod.init_remote_debugger(
        port=0, host="127.0.0.1", backend={backend!r}, enable=True
    )
    _said = {{"address": _end.address}} if _end else {{"error": "no listener started"}}
except BaseException as _e:
    _end, _said = None, {{"error": f"{{type(_e).__name__}}: {{_e}}"}}
with open({answer!r} + ".part", "w") as _f:
    _json.dump(_said, _f)
_os.replace({answer!r} + ".part", {answer!r})
if _end is not None:
    _here = _sys._getframe(0)
    _breakpod.set_trace(frame=_here.f_back or _here, header="parked by breakpod attach --pid")
"""


def attach_pid(
    pid: int, *, token: str | None = None, timeout: float = 30.0, inject: Inject | None = None
) -> int:
    """Park process ``pid`` through ``sys.remote_exec``, then attach to it here."""
    host, port = net.parse_address(park_pid(pid, timeout=timeout, inject=inject))
    attach.attach(host, port, token=token)
    return 0


def park_pid(pid: int, *, timeout: float, inject: Inject | None = None) -> str:
    """Have ``pid`` park on a listener of its own; return that listener's address."""
    run = inject or remote_exec(pid)
    job_tmp = Path(f"/proc/{pid}/root/tmp")
    if not job_tmp.is_dir():
        raise AttachError(f"attach --pid {pid}: no such process, or this user may not read it")
    name = f"breakpod-attach-{pid}-{secrets.token_hex(4)}"
    script, answer = job_tmp / f"{name}.py", job_tmp / f"{name}.json"
    script.write_text(
        INJECTED.format(answer=f"/tmp/{name}.json", backend=protocol.DEFAULT_LISTENER)
    )
    script.chmod(0o644)  # the job may run as another user
    try:
        try:
            run(pid, f"/tmp/{name}.py")
        except (OSError, RuntimeError, ValueError) as e:
            raise AttachError(refused(pid, e)) from e
        return _answer(answer, pid, timeout)
    finally:
        for path in (script, answer):
            path.unlink(missing_ok=True)


def _answer(path: Path, pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AttachError(
                f"attach --pid {pid}: the process reached no safe point in {timeout:g}s (its "
                f"main thread may wait in native code, e.g. a collective): see where with "
                f"`breakpod stacks --pid {pid}`"
            )
        time.sleep(0.05)
    said = json.loads(path.read_text())
    if "error" in said:
        raise AttachError(
            f"attach --pid {pid}: breakpod could not start in the process ({said['error']}); "
            "install breakpod into the job's environment"
        )
    return str(said["address"])


def remote_exec(pid: int, version: tuple[int, int] = sys.version_info[:2]) -> Inject:
    """This interpreter's ``sys.remote_exec``, or the reason it has none."""
    run = getattr(sys, "remote_exec", None)
    if run is None or version < (3, 14):
        raise AttachError(why_not(pid, version))
    return run  # type: ignore[no-any-return]


def refused(pid: int, error: BaseException) -> str:
    return (
        f"attach --pid {pid}: sys.remote_exec refused ({error}); the job must run Python "
        "3.14+ without -X disable_remote_debug or PYTHON_DISABLE_REMOTE_DEBUG, and this user "
        f"must be allowed to trace it; read its stacks with `breakpod stacks --pid {pid}`"
    )


def why_not(pid: int, version: tuple[int, int]) -> str:
    return (
        "attach --pid needs sys.remote_exec (PEP 768, Python 3.14+) in this interpreter "
        f"and the job's; this is Python {version[0]}.{version[1]}: read its stacks with "
        f"`breakpod stacks --pid {pid}`, or start the job under `breakpod run -- ...` to "
        "attach to it later"
    )
