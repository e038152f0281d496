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
from tests.valkey_aof import CASES as REDIS_7_CASES
from tests.valkey_aof import DAMAGED_INSIDE, redis_7_layout, valkey_bin

WHOLE = b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\n1\r\n"
MULTI = b"*1\r\n$5\r\nMULTI\r\n"
EXEC = b"*1\r\n$4\r\nEXEC\r\n"
MANIFEST = "appendonlydir/appendonly.aof.manifest"  # Redis 7's path, read by the 6.2 tool
SINGLE = "appendonly.aof"  # Redis 6.2

CASES = [
    (MANIFEST, None, None),  # the first start: no AOF yet, nothing to check
    (MANIFEST, WHOLE + MULTI + WHOLE + b"*3\r\n$3\r\nSE", WHOLE),  # cut back
    (MANIFEST, WHOLE * 3, WHOLE * 3),  # valid
    (MANIFEST, MULTI + WHOLE + MULTI + WHOLE + EXEC + WHOLE, None),  # damaged inside: left
    (SINGLE, WHOLE + MULTI + WHOLE, WHOLE),  # Redis 6.2's one file, cut back too
    (SINGLE, WHOLE + MULTI + WHOLE + b"*3\r\n$", WHOLE),  # cut in a header line: cut back
    (SINGLE, WHOLE + b"*3\r\n$", WHOLE),  # likewise, outside a transaction
    (SINGLE, b"", b""),  # Redis 6.2 makes an empty file before the first write
]
IDS = [
    "no-aof",
    "ends-in-a-transaction",
    "valid",
    "damaged-inside",
    "redis-6.2-file",
    "header-line-in-a-transaction",
    "header-line",
    "empty",
]


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
    command: list[str], tmp_path: Path, layout: str, content: bytes | None, tool: bool = True
) -> tuple[Path, list[str]]:
    """The AOF after the check ran (``tool``: with redis-check-aof on the PATH), and
    what it printed, the server's "server started" last."""
    aof = tmp_path / "data" / layout
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


@pytest.mark.parametrize(("layout", "content", "after"), CASES, ids=IDS)
def test_the_charts_redis_checks_its_aof_before_every_start(tmp_path, layout, content, after):
    """It cuts only a damaged end, leaves damage further in to Redis, then execs the server."""
    checked(chart_command(tmp_path / "data"), tmp_path, layout, content, after)


def checked(command: list[str], tmp_path: Path, layout: str, content: bytes | None, after) -> None:
    aof, said = run_check(command, tmp_path, layout, content)
    assert any("damaged" in line for line in said) == (content is CASES[3][1]), said
    if content is not None:
        assert aof.read_bytes() == (content if after is None else after)


@needs_compose
@pytest.mark.parametrize(("layout", "content", "after"), CASES, ids=IDS)
def test_composes_redis_checks_its_aof_before_every_start(tmp_path, layout, content, after):
    checked(compose_command(tmp_path / "data"), tmp_path, layout, content, after)


def test_without_redis_check_aof_the_server_still_starts(tmp_path):
    command = chart_command(tmp_path / "data")
    aof, said = run_check(command, tmp_path, SINGLE, WHOLE + MULTI, tool=False)
    assert said == ["redis-check-aof not found: the AOF was not checked", "server started"]
    assert aof.read_bytes() == WHOLE + MULTI


@pytest.mark.parametrize("case", REDIS_7_CASES)
@pytest.mark.parametrize("deployment", ["chart", pytest.param("compose", marks=needs_compose)])
def test_a_redis_7_manifests_last_file_is_checked_alike(tmp_path, deployment, case):
    """The offsets of a manifest's report point into the file that failed; the check
    reads its size from the report (the chart's image runs Redis 7)."""
    data = tmp_path / "data"
    incr, after = redis_7_layout(data, case)
    before = incr.read_bytes()
    command = chart_command(data) if deployment == "chart" else compose_command(data)
    said = run_script(command, tmp_path, valkey_bin())
    assert any("damaged" in line for line in said) == (case in DAMAGED_INSIDE), said
    assert incr.read_bytes() == (before if after is None else after)
    assert (data / MANIFEST).is_file()  # the layout the script looks for first
