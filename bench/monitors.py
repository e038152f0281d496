"""Cost of tensor monitors on CPU training steps, side by side.

Two models (a small ResNet-style CNN, batch 32 x 3x64x64, and a 4-layer
transformer encoder, batch 16 x 128 tokens x d_model 256), trained with SGD
under seven setups: no monitoring, breakpod disabled, breakpod default rules
with check_every=1 and 10, the default rules plus a ``break`` rule (judged
before ``optimizer.step()``: one host read per step), the per-layer
``.item()`` checks tutorials paste into training loops, and
``torch.autograd.detect_anomaly()``.

The setups run interleaved (a few steps of each, round after round) so that
drift on a shared machine hits them all alike; each ratio is the median, over
rounds, of a setup's step time over the baseline's in the same round (the
fastest of the round's few steps each, as preemption only ever adds time).
``torch.set_num_threads(1)`` keeps the ratios stable on busy cores. "host reads/step" counts the
device-to-host reads (syncs on a GPU) each approach performs per step.

    python bench/monitors.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import breakpod

TARGETS = {"disabled": 1.01, "check_every=1": 1.10, "check_every=10": 1.05, "break rule": 1.10}


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        Block(16, 16, 1),
        Block(16, 32, 2),
        Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
    return model, lambda: (x, y)


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def transformer() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    tokens = torch.randint(0, 1000, (16, 128))
    return Encoder(), lambda: (tokens, tokens.roll(1, dims=1).flatten())


class Setup:
    """One way of running training steps; ``reads`` counts host reads."""

    name = "baseline (no breakpod)"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.reads = 0

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after(self, loss: torch.Tensor) -> None:
        pass

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        started = time.perf_counter()
        with self.context():
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
        self.optimizer.step()
        self.after(loss)
        return time.perf_counter() - started


class Breakpod(Setup):
    def __init__(self, model: nn.Module, check_every: int, enabled: bool = True) -> None:
        super().__init__(model)
        os.environ["BREAKPOD_MONITOR"] = "1" if enabled else "0"
        self.monitor = breakpod.watch(model, check_every=check_every)
        os.environ.pop("BREAKPOD_MONITOR")
        self.name = (
            f"breakpod default rules, check_every={check_every}" if enabled else "breakpod disabled"
        )
        self.key = f"check_every={check_every}" if enabled else "disabled"

    def after(self, loss: torch.Tensor) -> None:
        self.monitor.step(loss)
        self.reads = self.monitor.reads


class BreakRule(Breakpod):
    """A ``break`` rule: each step is judged in the optimizer's pre-hook, one read per step."""

    name = "breakpod + a break rule, check_every=10"
    key = "break rule"

    def __init__(self, model: nn.Module) -> None:
        Setup.__init__(self, model)
        rules = [{"name": "nan-break", "check": "nonfinite", "action": "break"}]
        self.monitor = breakpod.watch(model, rules, optimizer=self.optimizer, check_every=10)


class ItemChecks(Setup):
    """The tutorial helpers: a forward hook per layer and a grad-norm loop, each ``.item()``."""

    name = "hand-written per-layer .item() checks"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for name, module in model.named_modules():
            if not list(module.children()):
                module.register_forward_hook(self._check(name))

    def _check(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return
            self.reads += 2
            if torch.isnan(out).any().item() or out.abs().max().item() > 1e4:
                print(f"bad activation in {name}")

        return hook

    def after(self, loss: torch.Tensor) -> None:
        self.reads += 1
        if not torch.isfinite(loss).item():
            print("loss is not finite")
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                self.reads += 1
                if p.grad.norm().item() > 1e3:
                    print(f"exploding gradient in {name}")


class DetectAnomaly(Setup):
    name = "torch.autograd.detect_anomaly()"

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.detect_anomaly(check_nan=True)

    def after(self, loss: torch.Tensor) -> None:
        self.reads += _count_nodes(loss.grad_fn)  # one NaN check (a sync) per backward node


def _count_nodes(fn: Any) -> int:
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return sum(1 for node in seen if type(node).__name__ != "AccumulateGrad")


def setups(build: Callable[[], Any]) -> Iterator[Setup]:
    def fresh() -> nn.Module:
        torch.manual_seed(0)
        model: nn.Module = build()[0]
        return model

    yield Setup(fresh())
    yield Breakpod(fresh(), 1, enabled=False)
    yield Breakpod(fresh(), 1)
    yield Breakpod(fresh(), 10)
    yield BreakRule(fresh())
    yield ItemChecks(fresh())
    yield DetectAnomaly(fresh())


Result = tuple[Setup, float, float]


def measure(build: Callable[[], Any], rounds: int, per_round: int, warmup: int) -> list[Result]:
    """Per setup: median over rounds of its step time / the baseline's that round; reads/step.

    Within a round each setup's fastest of ``per_round`` steps is taken: other
    processes on a shared machine only ever add time, and do so to every setup.
    """
    data = build()[1]
    runs = list(setups(build))
    with _quiet_warnings():
        for s in runs:
            for _ in range(warmup):
                s.step(*data())
            _reset_reads(s)
        ratios: dict[int, list[float]] = {id(s): [] for s in runs}
        for r in range(rounds):
            times = {}
            for s in runs[r % len(runs) :] + runs[: r % len(runs)]:
                times[id(s)] = min(s.step(*data()) for _ in range(per_round))
            for s in runs:
                ratios[id(s)].append(times[id(s)] / times[id(runs[0])])
    steps = rounds * per_round
    return [(s, statistics.median(ratios[id(s)]), s.reads / steps) for s in runs]


def _reset_reads(s: Setup) -> None:
    s.reads = 0
    if isinstance(s, Breakpod):
        s.monitor.reads = 0


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def table(results: dict[str, list[Result]]) -> str:
    names = list(results)
    header = f"{'setup':<42}" + "".join(f"{n + ' ratio':>20}{'host reads/step':>17}" for n in names)
    lines = [header, "-" * len(header)]
    for i, (setup, _, _) in enumerate(results[names[0]]):
        row = f"{setup.name:<42}"
        for n in names:
            _, ratio, reads = results[n][i]
            row += f"{ratio:>19.3f}x{reads:>17.1f}"
        lines.append(row)
    return "\n".join(lines)


def verdicts(results: dict[str, list[Result]]) -> list[str]:
    out = []
    for name, rows in results.items():
        ratio = {getattr(s, "key", type(s).__name__): r for s, r, _ in rows}
        for key, target in TARGETS.items():
            ok = "ok" if ratio[key] <= target else "MISSED"
            out.append(f"{name}: {key} {ratio[key]:.3f}x (target <= {target:.2f}x) {ok}")
        anomaly = ratio["DetectAnomaly"] - 1
        mine = ratio["check_every=1"] - 1
        ok = "ok" if mine < anomaly / 5 else "MISSED"
        out.append(
            f"{name}: overhead {mine:+.1%} vs detect_anomaly {anomaly:+.1%} (target < 1/5) {ok}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (CNN)")
    parser.add_argument("--steps", type=int, default=3, help="steps of each setup per round (CNN)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    big_rounds = max(3, 2 * args.rounds // 3)
    results = {
        "resnet": measure(resnet, args.rounds, args.steps, warmup=3),
        "transformer": measure(transformer, big_rounds, 1, warmup=2),
    }
    print(
        f"torch {torch.__version__}, CPU, 1 thread; ratio = median over interleaved rounds of "
        f"step time / baseline step time in the same round (CNN: {args.rounds} rounds, best of "
        f"{args.steps} steps each; transformer: {big_rounds} rounds of 1 step; after warm-up)"
    )
    print(table(results))
    print("\n".join(verdicts(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
