"""Stall detection: the cost of ``breakpod.step()`` with the watchdog on, and how
late a stall is reported after ``BREAKPOD_STALL_AFTER``.

Overhead: the CNN and transformer training steps of ``bench/monitors.py``,
without breakpod and with ``breakpod.step()`` after each step while the stall
watchdog runs, interleaved round after round; the ratio is the median over
rounds of the two step times in the same round (fastest of a round's steps).

The ratio is noisy on a shared machine (a few % either way), so the cost of
one call is also measured directly: nanoseconds against milliseconds of step.

Latency: the main thread steps, then blocks in ``threading.Event().wait()``
(as a dataloader deadlock does); latency is the time from the stall timeout to
the ``stall`` event, over 10 runs (p50 and max).

    python bench/stall.py [--rounds N] [--runs N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from monitors import Setup, resnet, stderr_to_devnull, transformer

import breakpod
from breakpod._core import events
from breakpod._job import boundary

TARGET = 1.005
STALL_AFTER = 2.0


class StallStep(Setup):
    name = "breakpod.step(), stall detection on"

    def after(self, loss: torch.Tensor) -> None:
        breakpod.step()


def overhead(build: Callable[[], Any], rounds: int, per_round: int) -> float:
    data = build()[1]
    torch.manual_seed(0)
    runs = [Setup(build()[0]), StallStep(build()[0])]
    for s in runs:
        for _ in range(2):
            s.step(*data())
    ratios = []
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        times = {id(s): min(s.step(*data()) for _ in range(per_round)) for s in order}
        ratios.append(times[id(runs[1])] / times[id(runs[0])])
    return statistics.median(ratios)


def call_cost(calls: int = 200_000) -> float:
    """Seconds per ``breakpod.step()`` call with the watchdog on (best of 5)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            breakpod.step()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def latency(runs: int) -> list[float]:
    """Seconds past STALL_AFTER until the stall event, one per run."""
    late = []
    for _ in range(runs):
        reported = threading.Event()

        def sink(event: events.Event, reported: threading.Event = reported) -> None:
            if event.kind == "stall":
                reported.set()

        events.add_sink(sink)
        dog = boundary.watch_stalls(STALL_AFTER)
        for _ in range(5):  # steps at a random phase of the watchdog's tick, as in training
            breakpod.step()
            time.sleep(random.uniform(0, STALL_AFTER / 4))
        breakpod.step()
        stepped = time.monotonic()
        reported.wait(STALL_AFTER + 30)  # the main thread blocked in C, as in a deadlock
        late.append(time.monotonic() - stepped - STALL_AFTER)
        events.remove_sink(sink)
        dog.stop()
    return late


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (CNN)")
    parser.add_argument("--runs", type=int, default=10, help="stalls for the latency")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    boundary.watch_stalls(3600.0)  # on, and never firing during the overhead rounds
    ratios = {
        "resnet": overhead(resnet, args.rounds, 3),
        "transformer": overhead(transformer, max(3, 2 * args.rounds // 3), 1),
    }
    cost = call_cost()
    print(f"one breakpod.step() call with stall detection on: {cost * 1e9:.0f} ns")
    for name, ratio in ratios.items():
        ok = "ok" if ratio <= TARGET else "MISSED (noise: see the per-call cost)"
        print(
            f"{name}: breakpod.step() with stall detection {ratio:.4f}x (target <= {TARGET}x) {ok}"
        )
    with stderr_to_devnull():  # the stall reports themselves (written to fd 2)
        late = latency(args.runs)
    print(
        f"detection latency past BREAKPOD_STALL_AFTER={STALL_AFTER:g}s over {len(late)} stalls: "
        f"p50 {statistics.median(late):.2f}s, max {max(late):.2f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
