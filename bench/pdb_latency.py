"""Time from ``breakpoint()`` to a listener that accepts connections.

Each case runs in a fresh headless child that has imported torch, as a
training job would have. The child stamps CLOCK_MONOTONIC
(shared by all processes on Linux) just before breaking; this process
connects in a tight loop and stamps the first successful connect. The
client then disconnects, which every listener treats as "continue".
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

CASES = {
    "breakpod set_trace (cold: bind on first break)": (
        "import os, time; os.environ['PYTHONBREAKPOINT']='breakpod.set_trace'",
        "breakpoint()",
    ),
    "breakpod set_trace (port pre-bound by init_remote_debugger)": (
        "import breakpod; breakpod.init_remote_debugger(port=PORT, backend='pdb', enable=True)",
        "breakpoint()",
    ),
    "remote-pdb RemotePdb(...).set_trace()": (
        "from remote_pdb import RemotePdb",
        "RemotePdb('127.0.0.1', PORT).set_trace()",
    ),
    "debugpy.listen() (no break: listener start only)": (
        "import debugpy",
        "debugpy.listen(('127.0.0.1', PORT))",
    ),
}
CHILD = """
import time
import torch  # a training job has torch (and the stdlib it pulls in) loaded already
{setup}
print(time.monotonic(), flush=True)
{action}
time.sleep(0.2)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def once(setup: str, action: str) -> float:
    port = free_port()
    code = CHILD.format(setup=setup, action=action).replace("PORT", str(port))
    env = {**os.environ, "PYTHONBREAKPOINT": "breakpod.set_trace", "BREAKPOD_PORT": str(port)}
    env.pop("REMOTE_PDB_HOST", None)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    assert child.stdout is not None
    started = float(child.stdout.readline())
    accepted = connect_when_ready(port)
    child.kill()
    child.wait()
    return accepted - started


def connect_when_ready(port: int, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return time.monotonic()
        except OSError:
            time.sleep(0.0005)
    raise TimeoutError(f"nothing listened on {port}")


def available(setup: str) -> bool:
    module = setup.split()[1].split(".")[0].rstrip(";,")
    check = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
    return check.returncode == 0


def main(repeats: int = 5) -> list[tuple[str, float]]:
    rows = []
    for name, (setup, action) in CASES.items():
        if not available(setup):
            print(f"  (skipped {name}: not installed)")
            continue
        samples = [once(setup, action) for _ in range(repeats)]
        rows.append((name, statistics.median(samples)))
    reference = rows[0][1]
    print(f"\nbreakpoint() -> listener accepting (median of {repeats} headless children)")
    print(f"{'approach':64} {'ms':>8} {'vs breakpod':>12}")
    for name, seconds in rows:
        print(f"{name:64} {seconds * 1000:8.1f} {seconds / reference:11.2f}x")
    return rows


if __name__ == "__main__":
    main()
