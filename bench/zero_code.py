"""Cost of debug mode with no code (``ENABLE_REMOTE_DEBUG=1`` alone), side by side.

The CNN, the transformer and the 200-module MLP of ``bench/monitors.py``, trained
with SGD: no breakpod, and debug mode's zero-code hooks as the autostart ``.pth``
installs them (the optimizer's steps as step boundaries with the stall watchdog
running, the model found at the first step and watched with the default rules, a
non-finite value parking before the update: one host read per step).

torch's global hooks apply to every optimizer in the process, so each zero-code
setup puts them in place for its own steps only (a dict insert and delete, well
under a microsecond against milliseconds of step). The setups run interleaved,
round after round; a ratio is the median over rounds of the setup's step time
over the baseline's in the same round (fastest of the round's steps).

    python bench/zero_code.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from monitors import Setup, mlp, resnet, transformer
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

from breakpod._integrations import autowatch

TARGET = 1.02  # the target for zero-code debug mode
HOOK_TABLES: tuple[dict[int, Any], ...] = (
    torch_optimizer._global_optimizer_pre_hooks,
    torch_optimizer._global_optimizer_post_hooks,
    torch_module._global_forward_pre_hooks,
)


class ZeroCode(Setup):
    """Debug mode's global hooks, in place only while this setup steps."""

    name = "zero-code debug mode"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        autowatch.remove()  # the previous model's: one zero-code setup at a time
        before = [set(table) for table in HOOK_TABLES]
        autowatch.install()
        self.hooks = [
            {k: v for k, v in table.items() if k not in old}
            for table, old in zip(HOOK_TABLES, before, strict=True)
        ]
        self._take_out()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        for table, mine in zip(HOOK_TABLES, self.hooks, strict=True):
            table.update(mine)
        try:
            return super().step(x, y)
        finally:
            self._take_out()

    def _take_out(self) -> None:
        if autowatch._forward_handle is None:  # removed at the first step, as in a job
            self.hooks[2] = {}
        for table, mine in zip(HOOK_TABLES, self.hooks, strict=True):
            for key in mine:
                table.pop(key, None)


def measure(build: Callable[[], Any], rounds: int, per_round: int) -> float:
    """The median over rounds of the zero-code step time over the baseline's."""
    data = build()[1]
    torch.manual_seed(0)
    base = Setup(build()[0])
    torch.manual_seed(0)
    runs = [base, ZeroCode(build()[0])]
    for s in runs:
        for _ in range(3):
            s.step(*data())
    ratios = []
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        times = {id(s): min(s.step(*data()) for _ in range(per_round)) for s in order}
        ratios.append(times[id(runs[1])] / times[id(base)])
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["ENABLE_REMOTE_DEBUG"] = "1"  # the watchdog starts at the first boundary
    os.environ["BREAKPOD_PORT"] = "0"
    models = {
        "resnet": (resnet, args.rounds, 3),
        "transformer": (transformer, max(3, 2 * args.rounds // 3), 1),
        "mlp200": (mlp(200), args.rounds, 3),
    }
    results = {name: measure(build, r, n) for name, (build, r, n) in models.items()}
    for name, ratio in results.items():
        ok = "ok" if ratio <= TARGET else "MISSED"
        print(f"{name}: zero-code debug mode {ratio:.3f}x (target <= {TARGET}x) {ok}")
    autowatch.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
