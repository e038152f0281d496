"""The attach instructions for a held failure, in a block that stands out in CI logs.

GitHub Actions also gets an ``::error`` workflow command (an annotation on the
run page and on the failing line); GitLab CI gets a collapsible log section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import TextIO

from breakpod import protocol
from breakpod._core import net
from breakpod._core.config import format_seconds
from breakpod._core.hosting import Hosting, reach_hints

WIDTH = 88
DETACH = {
    "pdb": "type c (continue) or Ctrl-D; the run goes on",
    "debugpy": "continue or disconnect in the IDE; the run goes on",
}
RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


@dataclasses.dataclass(frozen=True)
class Failure:
    """One held failure: what failed, where, and where the debugger listens."""

    test: str
    error: str
    file: str
    line: int
    backend: str
    host: str
    port: int
    hold_seconds: float

    @property
    def address(self) -> str:
        return net.format_address(self.host, self.port)

    @property
    def hold(self) -> str:
        return format_seconds(self.hold_seconds)


def show(failure: Failure, hosting: Hosting) -> None:
    """Print the block on the real stderr, plus the CI system's annotation."""
    block = render(failure, hosting)
    for stream in (sys.stdout, sys.__stdout__):  # what the program printed comes first
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()  # type: ignore[union-attr]  # None is an AttributeError too
    if hosting.gitlab:
        block = gitlab_section(block, f"breakpod: {failure.test} is held for a debugger")
    _write(sys.__stderr__, block)
    if hosting.github:
        _write(sys.__stdout__, github_annotation(failure))


def render(failure: Failure, hosting: Hosting) -> str:
    title = f" breakpod: {failure.test} failed; held for a debugger "
    rows = [
        ("error", failure.error),
        ("where", f"{_relative(failure.file)}:{failure.line}"),
        ("attach", _attach_line(failure)),
        ("hold", f"{failure.hold}, then the run continues (exit status unchanged)"),
    ]
    rows += [("reach", hint) for hint in reach_hints(hosting, failure.host, failure.port)]
    rows.append(("detach", DETACH[failure.backend]))  # a row label
    body = [f"  {name:<7} {text}" for name, text in rows]
    return "\n".join(["", title.center(WIDTH, "!"), *body, "!" * WIDTH, ""])


def _attach_line(failure: Failure) -> str:
    if failure.backend == protocol.DAP_LISTENER:
        return (
            f"VS Code / DAP client to {failure.address}  "
            f"(breakpod attach --vscode {failure.address} prints a launch.json)"
        )
    return f"breakpod attach {failure.address}   (or: nc {failure.host} {failure.port})"


def _relative(path: str, start: str | None = None) -> str:
    try:
        relative = os.path.relpath(path, start)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def github_annotation(failure: Failure) -> str:
    """A ``::error`` workflow command; GitHub shows it on the run and on the line."""
    file = _relative(failure.file, os.environ.get("GITHUB_WORKSPACE"))
    props = {"file": file, "line": str(failure.line), "title": "breakpod: test held"}
    message = (
        f"{failure.test} failed ({failure.error}); held {failure.hold} for a debugger: "
        f"{_attach_line(failure)}"
    )
    joined = ",".join(f"{k}={_escape(v, prop=True)}" for k, v in props.items())
    return f"::error {joined}::{_escape(message)}"


def _escape(text: str, *, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def gitlab_section(block: str, header: str) -> str:
    """GitLab's collapsible section markers (expanded), header in red."""
    stamp, name = int(time.time()), "breakpod_held_failure"
    start = f"\x1b[0Ksection_start:{stamp}:{name}[collapsed=false]\r\x1b[0K"
    end = f"\x1b[0Ksection_end:{stamp}:{name}\r\x1b[0K"
    return f"{start}{RED}{BOLD}{header}{RESET}{block}{end}"


def _write(stream: TextIO | None, text: str) -> None:
    if stream is None:
        return
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
