"""``breakpod attach --pid PID``: a running process that never imported breakpod.

Python 3.14's ``sys.remote_exec`` (PEP 768) could run breakpod inside such a
process at its next safe point. This release does not inject: an injector that
cannot be tried against a 3.14 interpreter here would be run first on someone's
training job. Every interpreter gets one line that says why not and what reads
the process today (``breakpod stacks --pid``, with no code in it).
"""

from __future__ import annotations

import sys

from breakpod._core.errors import AttachError


def attach_pid(pid: int, version: tuple[int, int] = sys.version_info[:2]) -> int:
    raise AttachError(why_not(pid, version))


def why_not(pid: int, version: tuple[int, int]) -> str:
    instead = (
        f"read its stacks with `breakpod stacks --pid {pid}`, or start the job under "
        "`breakpod run -- ...` to attach to it later"
    )
    if version < (3, 14):
        return (
            f"attach --pid needs sys.remote_exec (PEP 768, Python 3.14+) in this interpreter "
            f"and the job's; this is Python {version[0]}.{version[1]}: {instead}"
        )
    return f"attach --pid: injecting breakpod into a running process is not built yet; {instead}"
