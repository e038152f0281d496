"""``breakpod stacks --pid``: the pause py-spy imposes on a process it reads, and the
time to a job report for 8 local ranks that never imported breakpod.

Pause: a process spins, noting the longest gap between two reads of its clock in
each 0.4 s window; py-spy dumps it once in every other window. The pause is the
longest gap of a dump's window, against the windows with no dump (the machine's
own noise), for py-spy's default (it stops the process while it reads), with
``--nonblocking`` (it does not: the stack may tear) and with ``--native``.

Report: torchrun runs 8 ranks of ``tests/distributed/pristine_job.py`` (gloo, CPU),
rank 3 blocked in a helper; the time from ``breakpod stacks --pid <torchrun>`` to
its report, over a few runs, and whether it named rank 3.

    python bench/stacks.py [--dumps N] [--runs N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPY = Path(sys.executable).with_name("py-spy")
TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB = ROOT / "tests" / "distributed" / "pristine_job.py"
WINDOW = 0.4
SPINNER = f"""
import sys, time
clock = time.perf_counter
print("up", flush=True)
while True:
    end = clock() + {WINDOW}
    last = gap = 0.0
    last = clock()
    while last < end:
        now = clock()
        gap = max(gap, now - last)
        last = now
    print(f"{{gap:.6f}}", flush=True)
"""


@contextlib.contextmanager
def spinner() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNER], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def pauses(flags: list[str], dumps: int) -> tuple[list[float], list[float], list[float]]:
    """Longest gaps (s) of windows with a dump and without, and each dump's wall time."""
    with spinner() as proc:
        assert proc.stdout is not None
        quiet, loud, walls = [], [], []
        proc.stdout.readline()  # a partial window
        for _ in range(dumps):
            quiet.append(float(proc.stdout.readline()))
            started = time.monotonic()
            subprocess.run(
                [str(SPY), "dump", "--pid", str(proc.pid), *flags],
                capture_output=True,
                check=True,
                timeout=60,
            )
            walls.append(time.monotonic() - started)
            loud.append(float(proc.stdout.readline()))
            if walls[-1] > WINDOW:  # the dump outlasted its window: take the larger
                loud[-1] = max(loud[-1], float(proc.stdout.readline()))
    return loud, quiet, walls


def ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values) * 1e3:7.2f} ms, max {max(values) * 1e3:7.2f} ms"


@contextlib.contextmanager
def job(ranks: int, port: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "STALL_RANK": "3"}
    err = tempfile.NamedTemporaryFile(prefix="bench-stacks-", suffix=".err")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(str(TORCHRUN), f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1"),
            *(f"--master-port={port}", f"--rdzv-id=bench-{port}", str(JOB)),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while b"rank 3 stalls now" not in Path(err.name).read_bytes():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(Path(err.name).read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        time.sleep(2.0)  # the other ranks reach DDP's all_reduce
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
        err.close()


def report_times(ranks: int, runs: int) -> tuple[list[float], list[str]]:
    times, culprits = [], []
    with job(ranks, 29690) as launcher:
        for _ in range(runs):
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "breakpod._cli.main", "stacks", "--pid", str(launcher.pid)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            times.append(time.monotonic() - started)
            culprits.append(done.stdout.splitlines()[1] if done.returncode == 0 else done.stderr)
    return times, culprits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dumps", type=int, default=15)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args(argv)
    if not SPY.exists():
        print("py-spy is not installed: pip install 'breakpod[stacks]'")
        return 0
    print(f"the pause a process sees while py-spy dumps it ({args.dumps} dumps each)")
    for label, flags in (
        ("py-spy dump (default: stops it)", []),
        ("py-spy dump --nonblocking", ["--nonblocking"]),
        ("py-spy dump --native", ["--native"]),
    ):
        loud, quiet, walls = pauses(flags, args.dumps)
        print(f"  {label:34s} longest gap {ms(loud)}; dump wall {ms(walls)}")
    noise = "no dump (the machine's own noise)"
    print(f"  {noise:34s} longest gap {ms(quiet)}")
    times, culprits = report_times(args.ranks, args.runs)
    print(f"time to the report, {args.ranks} local ranks (torchrun, gloo), rank 3 blocked:")
    print(f"  breakpod stacks --pid <torchrun>   {ms(times)}")
    print(f"  {culprits[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
