"""Which compose the tests run: `docker compose` (v2, a docker CLI plugin) when
the docker CLI has it, else `docker-compose` (v1, what Debian ships), else none.
Both read compose.yml and its overlays the same way."""

from __future__ import annotations

import functools
import shutil
import subprocess


@functools.cache
def compose_command() -> tuple[str, ...] | None:
    docker = shutil.which("docker")
    if docker and _answers([docker, "compose", "version"]):
        return (docker, "compose")
    v1 = shutil.which("docker-compose")
    return (v1,) if v1 and _answers([v1, "version"]) else None


def _answers(cmd: list[str]) -> bool:
    """The command runs and exits 0 (no daemon needed for `version`)."""
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
