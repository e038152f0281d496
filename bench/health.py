"""Cost of the health toolkit's phase timers and memory tracking on CPU training steps.

The CNN and the transformer of ``bench/monitors.py``, trained with SGD (one
model and its data shared by the setups, so only the timers differ) under
three setups: no timers, ``breakpod.phase`` around data/forward/backward/
optimizer (four phases a step), and the same with ``track_memory()`` (the RSS
read per phase off CUDA). Interleaved rounds and median ratios, as in
``bench/monitors.py``; targets: <= 1.01x each. A shared machine's noise is
larger than a phase's cost, so the cost of an empty phase is also measured
directly, and the ratio it implies (1 + 4 phases x cost / baseline step) printed.

    python bench/health.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from monitors import resnet, transformer
from torch import nn

import breakpod
from breakpod.health._phases import PhaseTimers

TARGET = 1.01


class Plain:
    name = "baseline (no timers)"

    def __init__(self, model: nn.Module, data: Callable[[], Any]) -> None:
        self.model, self.data = model, data
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(self) -> float:
        started = time.perf_counter()
        x, y = self.data()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - started


class Timed(Plain):
    name = "breakpod.phase x4 per step"

    def __init__(self, model: nn.Module, data: Callable[[], Any], memory: bool = False) -> None:
        super().__init__(model, data)
        self.timers = PhaseTimers()
        self.timers.memory = memory
        if memory:
            self.name = "breakpod.phase x4 + track_memory"

    def step(self) -> float:
        timers, phase = self.timers, breakpod.health.phase
        started = time.perf_counter()
        with phase("data", timers):
            x, y = self.data()
        with phase("forward", timers):
            loss = nn.functional.cross_entropy(self.model(x), y)
        with phase("backward", timers):
            self.optimizer.zero_grad()
            loss.backward()
        with phase("optimizer", timers):
            self.optimizer.step()
        return time.perf_counter() - started


def phase_cost_us(memory: bool, n: int = 50_000) -> float:
    """Microseconds of one empty ``with phase(...)`` (best of three runs)."""
    timers = PhaseTimers()
    timers.memory = memory
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(n):
            with breakpod.health.phase("x", timers):
                pass
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


def baseline_ms(build: Callable[[], Any]) -> float:
    torch.manual_seed(0)
    plain = Plain(*build())
    return 1000 * min(plain.step() for _ in range(5))


def measure(build: Callable[[], Any], rounds: int, per_round: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    model, data = build()  # one model for all: only the timers differ between setups
    again = Plain(model, data)
    again.name = "baseline again (the noise floor)"
    runs = [Plain(model, data), again, Timed(model, data), Timed(model, data, memory=True)]
    for s in runs:
        for _ in range(2):
            s.step()
    ratios: dict[int, list[float]] = {id(s): [] for s in runs}
    for r in range(rounds):
        times = {}
        for s in runs[r % len(runs) :] + runs[: r % len(runs)]:
            times[id(s)] = min(s.step() for _ in range(per_round))
        for s in runs:
            ratios[id(s)].append(times[id(s)] / times[id(runs[0])])
    return [(s.name, statistics.median(ratios[id(s)])) for s in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (CNN)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {
        "resnet": measure(resnet, args.rounds, 3),
        "transformer": measure(transformer, max(3, args.rounds // 2), 1),
    }
    print(f"torch {torch.__version__}, CPU, 1 thread; ratio = median step time / baseline's")
    print(f"{'setup':<36}" + "".join(f"{name + ' ratio':>20}" for name in results))
    for i, (name, _) in enumerate(results["resnet"]):
        print(f"{name:<36}" + "".join(f"{rows[i][1]:>19.3f}x" for rows in results.values()))
    for model, rows in results.items():
        for name, ratio in rows[2:]:
            ok = "ok" if ratio <= TARGET else "MISSED"
            print(f"{model}: {name} {ratio:.3f}x (target <= {TARGET:.2f}x) {ok}")
    costs = {"timers": phase_cost_us(False), "timers + memory": phase_cost_us(True)}
    for model, build in (("resnet", resnet), ("transformer", transformer)):
        step = baseline_ms(build)
        for what, us in costs.items():
            implied = 1 + 4 * us / 1000 / step
            ok = "ok" if implied <= TARGET else "MISSED"
            print(
                f"{model}: {what}: {us:.1f} us a phase, step {step:.1f} ms -> "
                f"{implied:.4f}x implied (target <= {TARGET:.2f}x) {ok}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
