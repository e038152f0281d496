"""Cost of time travel on the CNN and transformer steps of bench/monitors.py.

* capture: the per-step cost of keeping what ``replay`` needs (root inputs,
  RNG states, running statistics, the output gradient): step time with
  ``watch(model, optimizer=opt, replay=True)`` over ``replay=False`` (same
  default rules, so the ratio is the capture alone), interleaved round by
  round, medians of the fastest step per round;
* flight: the flight recorder's per-step cost (two kernels per watched tensor,
  one ring copy per device): ``BREAKPOD_FLIGHT_STEPS=64`` over ``0``, same
  rules, measured the same way;
* replay: one ``monitor.replay()`` (forward + backward under op
  instrumentation) over one normal step;
* whatif: one ``whatif lr=1e-4`` (deep copy, two steps) over one normal step.

    python bench/timetravel.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from monitors import resnet, transformer

import breakpod
from breakpod._monitor.flight.recorder import FLIGHT_ENV
from breakpod._monitor.timetravel import whatif

TARGET_CAPTURE = 1.03
TARGET_FLIGHT = 1.02


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> float:
    started = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - started


def _setup(build: Callable[[], Any], replay: bool, flight: int = 64) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model, data = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    os.environ[FLIGHT_ENV] = str(flight)  # read when watch() installs its hooks
    monitor = breakpod.watch(model, optimizer=opt, replay=replay)
    return model, opt, (monitor, data)


def step_ratio(
    build: Callable[[], Any],
    rounds: int,
    per_round: int,
    base: dict[str, Any],
    other: dict[str, Any],
) -> tuple[float, float]:
    """Median over rounds of (fastest ``other`` step / fastest ``base`` step), interleaved."""
    setups = {False: _setup(build, **base), True: _setup(build, **other)}
    ratios, base_times = [], []
    for _ in range(rounds):
        best = {}
        for flag, (model, opt, (_, data)) in setups.items():
            x, y = data()
            best[flag] = min(_train_step(model, opt, x, y) for _ in range(per_round))
        ratios.append(best[True] / best[False])
        base_times.append(best[False])
    for _, _, (monitor, _) in setups.values():
        monitor.close()
    return statistics.median(ratios), statistics.median(base_times)


def replay_cost(build: Callable[[], Any], step_time: float) -> tuple[float, float]:
    model, opt, (monitor, data) = _setup(build, True)
    x, y = data()
    _train_step(model, opt, x, y)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()  # parked state: the step's gradients, before the update
    started = time.perf_counter()
    monitor.replay()
    replay_s = time.perf_counter() - started
    started = time.perf_counter()
    change, _ = whatif.parse_change("lr=1e-4")
    assert monitor.capture is not None and monitor.capture.last is not None
    whatif.whatif(model, opt, monitor.capture.last, change, real_loss=None, loss_fn=None)
    whatif_s = time.perf_counter() - started
    monitor.close()
    return replay_s / step_time, whatif_s / step_time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    head = (
        f"{'model':<12} {'capture x':>10} {'flight x':>9} {'replay/step':>12} {'whatif/step':>12}"
    )
    print(f"{head} {'step ms':>8}")
    for name, build in (("cnn", resnet), ("transformer", transformer)):
        off = {"replay": False}
        capture, step_s = step_ratio(build, args.rounds, 3, off, {"replay": True})
        flight, _ = step_ratio(build, args.rounds, 3, {**off, "flight": 0}, {**off, "flight": 64})
        replay_x, whatif_x = replay_cost(build, step_s)
        marks = [f"capture over {TARGET_CAPTURE}x"] if capture > TARGET_CAPTURE else []
        marks += [f"flight over {TARGET_FLIGHT}x"] if flight > TARGET_FLIGHT else []
        print(
            f"{name:<12} {capture:>9.3f}x {flight:>8.3f}x {replay_x:>11.1f}x {whatif_x:>11.1f}x "
            f"{step_s * 1000:>8.1f}{'  (' + ', '.join(marks) + ')' if marks else ''}",
            flush=True,
        )


if __name__ == "__main__":
    main()
