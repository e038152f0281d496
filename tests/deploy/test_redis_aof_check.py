"""The AOF check every deployment's Redis runs before it starts (the chart's container
command and compose's entrypoint, one script: helm/breakpod/files/redis-aof-check.sh),
run for real by sh with this machine's redis-check-aof: the server binary under that
name, Redis 6.2 here."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("breakpod_broker")

from breakpod_broker.redis_server import find_binary
from tests.deploy.conftest import ROOT, documents, find, render
from tests.deploy.test_compose_docker import compose_config, needs_compose
from tests.valkey_aof import REDIS_7_CASES, resp, valkey_bin

WHOLE = resp("SET", "a", "1")
MULTI, EXEC = resp("MULTI"), resp("EXEC")
MANIFEST = "appendonlydir/appendonly.aof.manifest"  # Redis 7 (real ones: REDIS_7_CASES)
SINGLE = "appendonly.aof"  # Redis 6.2, the redis-check-aof here

# Redis 6.2's one file: (content, what the check leaves, whether it reports damage)
CASES = {
    "no-aof": (None, None, False),  # the first start: nothing to check
    "ends-in-a-transaction": (WHOLE + MULTI + WHOLE, WHOLE, False),
    "header-line-in-a-transaction": (WHOLE + MULTI + WHOLE + b"*3\r\n$", WHOLE, False),
    "header-line": (WHOLE + b"*3\r\n$", WHOLE, False),  # likewise, outside a transaction
    "valid": (WHOLE * 3, WHOLE * 3, False),
    "damaged-inside": (MULTI + WHOLE + MULTI + WHOLE + EXEC + WHOLE, None, True),  # left
    "empty": (b"", b"", False),  # Redis 6.2 makes an empty file before the first write
}


def chart_command(data: Path) -> list[str]:
    redis = find(documents(render()), "StatefulSet")["spec"]["template"]["spec"]
    container: dict[str, Any] = redis["containers"][0]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    return [c.replace("/data/", f"{data}/") for c in container["command"]]


def mount(volume: str | dict[str, str]) -> tuple[str, str]:
    """``(target, source)`` of a volume as compose v2 (long form) or v1 (short) prints it."""
    if isinstance(volume, dict):
        return volume["target"], volume["source"]
    source, target = volume.split(":")[:2]
    return target, source


def compose_command(data: Path) -> list[str]:
    redis = compose_config("compose.yml")["services"]["redis"]
    entrypoint: list[str] = redis["entrypoint"]
    mounts = dict(mount(v) for v in redis["volumes"])
    script = Path(mounts[entrypoint[1]])
    assert script == ROOT / "helm/breakpod/files/redis-aof-check.sh"
    assert "/data" in mounts
    copy = data.parent / "redis-aof-check.sh"
    copy.write_text(script.read_text().replace("/data/", f"{data}/"))
    return [entrypoint[0], str(copy)]  # docker-entrypoint.sh and the server args follow


def run_check(
    command: list[str], tmp_path: Path, content: bytes | None, tool: bool = True
) -> tuple[Path, list[str]]:
    """Redis 6.2's AOF after the check ran (``tool``: with redis-check-aof on the PATH),
    and what it printed, the server's "server started" last."""
    aof = tmp_path / "data" / SINGLE
    if content is not None:
        aof.parent.mkdir(parents=True)
        aof.write_bytes(content)
    return aof, run_script(command, tmp_path, Path(find_binary()) if tool else None)


def run_script(command: list[str], tmp_path: Path, tool: Path | None) -> list[str]:
    """What the check printed, run with ``tool`` as redis-check-aof (None: none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if tool is not None:
        (bin_dir / "redis-check-aof").symlink_to(tool)
    done = subprocess.run(
        [*command, "echo", "server started"],  # in place of the server and its arguments
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    said = done.stdout.decode().splitlines()
    assert said[-1] == "server started"
    return said


@pytest.mark.parametrize("case", CASES)
def test_the_charts_redis_checks_its_aof_before_every_start(tmp_path, case):
    """It cuts only a damaged end, leaves damage further in to Redis, then execs the server."""
    checked(chart_command(tmp_path / "data"), tmp_path, *CASES[case])


def checked(
    command: list[str], tmp_path: Path, content: bytes | None, after: bytes | None, reported: bool
) -> None:
    aof, said = run_check(command, tmp_path, content)
    assert any("damaged" in line for line in said) == reported, said
    if content is not None:
        assert aof.read_bytes() == (content if after is None else after)


@needs_compose
@pytest.mark.parametrize("case", CASES)
def test_composes_redis_checks_its_aof_before_every_start(tmp_path, case):
    checked(compose_command(tmp_path / "data"), tmp_path, *CASES[case])


def test_without_redis_check_aof_the_server_still_starts(tmp_path):
    command = chart_command(tmp_path / "data")
    aof, said = run_check(command, tmp_path, WHOLE + MULTI, tool=False)
    assert said == ["redis-check-aof not found: the AOF was not checked", "server started"]
    assert aof.read_bytes() == WHOLE + MULTI


@pytest.mark.parametrize("case", REDIS_7_CASES)
@pytest.mark.parametrize("deployment", ["chart", pytest.param("compose", marks=needs_compose)])
def test_a_redis_7_manifests_last_file_is_checked_alike(tmp_path, deployment, case):
    """The offsets of a manifest's report point into the file that failed; the check
    reads its size from the report (the chart's image runs Redis 7)."""
    data = tmp_path / "data"
    make, reported = REDIS_7_CASES[case]
    incr, after = make(data)
    before = incr.read_bytes()
    command = chart_command(data) if deployment == "chart" else compose_command(data)
    said = run_script(command, tmp_path, valkey_bin())
    assert any("damaged" in line for line in said) == reported, said
    assert incr.read_bytes() == (before if after is None else after)
    assert (data / MANIFEST).is_file()  # the layout the script looks for first
