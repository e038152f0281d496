"""Cost of time travel on the CNN and transformer steps of bench/monitors.py.

* capture: the per-step cost of keeping what ``replay`` needs (root inputs,
  RNG states, running statistics, the output gradient): step time with
  ``watch(model, optimizer=opt, replay=True)`` over ``replay=False`` (same
  default rules, so the ratio is the capture alone), interleaved round by
  round, medians of the fastest step per round;
* replay: one ``monitor.replay()`` (forward + backward under op
  instrumentation) over one normal step;
* whatif: one ``whatif lr=1e-4`` (deep copy, two steps) over one normal step.

    python bench/timetravel.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from monitors import resnet, transformer

import breakpod
from breakpod._monitor import whatif

TARGET_CAPTURE = 1.03


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> float:
    started = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - started


def _setup(build: Callable[[], Any], replay: bool) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model, data = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = breakpod.watch(model, optimizer=opt, replay=replay)
    return model, opt, (monitor, data)


def capture_ratio(build: Callable[[], Any], rounds: int, per_round: int) -> tuple[float, float]:
    setups = {flag: _setup(build, flag) for flag in (False, True)}
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
    print(f"{'model':<12} {'capture x':>10} {'replay/step':>12} {'whatif/step':>12} {'step ms':>8}")
    for name, build in (("cnn", resnet), ("transformer", transformer)):
        ratio, step_s = capture_ratio(build, args.rounds, 3)
        replay_x, whatif_x = replay_cost(build, step_s)
        mark = "" if ratio <= TARGET_CAPTURE else f"  (over {TARGET_CAPTURE}x)"
        print(
            f"{name:<12} {ratio:>9.3f}x {replay_x:>11.1f}x {whatif_x:>11.1f}x "
            f"{step_s * 1000:>8.1f}{mark}",
            flush=True,
        )


if __name__ == "__main__":
    main()
