"""Cost of tensor monitors on CPU training steps, side by side.

Two models (a small ResNet-style CNN, batch 32 x 3x64x64, and a 4-layer
transformer encoder, batch 16 x 128 tokens x d_model 256), trained with SGD
under eleven setups: no monitoring, breakpod disabled, breakpod's detailed tier
(per-module hooks; the default sentinel tier is bench/sentinel.py's) with the
default rules at check_every=1 and 10, the default rules less the flight recorder and
less the input-gradient checks (what each of those costs), the default
rules plus a ``break`` rule (judged
before ``optimizer.step()``: one host read per step), 20 lines of
hand-written hooks writing non-finite flags into a device tensor (read once
per step: the floor of per-module checking), the leanest hand-written hooks
that read what the default non-finite rule reads (every module's output and
input gradient, one sum each into a device tensor read once a step: a lower
bound on the default rules' cost), the per-layer ``.item()``
checks tutorials paste into training loops, and
``torch.autograd.detect_anomaly()``. Then MLPs of 10 to 800 small
Linear+ReLU modules, where the per-module cost shows: baseline, breakpod at
check_every=1 and 10 and less each of those two checks, the two kinds of
hand-written hooks, and the hook floor (empty forward hooks that put empty pre-hooks on the
input gradients' nodes: the Python any per-module check of outputs and input
gradients pays before it computes anything), with the added µs per module and per step. Last, each
setup's peak resident memory, one fresh process per setup (``VmHWM``), and
the top-level torch ops per step (the kernel launches on a GPU) from
``torch.profiler``, and the garbage collector's time per step (each MLP setup
alone: the fastest-step ratios leave out the rare long pauses of full
collections).

The setups run interleaved (a few steps of each, round after round) so that
drift on a shared machine hits them all alike; each ratio is the median, over
rounds, of a setup's step time over the baseline's in the same round (the
fastest of the round's few steps each, as preemption only ever adds time).
``torch.set_num_threads(1)`` keeps the ratios stable on busy cores. "host reads/step" counts the
device-to-host reads (syncs on a GPU) each approach performs per step.

    python bench/monitors.py [--rounds N] [--quick] [--cpu-time]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import breakpod

TARGETS = {"disabled": 1.01, "check_every=1": 1.05, "check_every=10": 1.02, "break rule": 1.10}
MLP_SIZES = (10, 50, 200, 800)
MLP_PER_MODULE_US = 10.0  # target: added µs per watched module per step
RSS_SLACK = 1.05  # target: peak RSS with monitors <= baseline + 5%
# Step timer. ``--cpu-time`` uses this thread's CPU time instead: on a shared machine a
# preempted step then does not count (cache and core contention still do).
CLOCK = time.perf_counter


class Block(nn.Module):
    """torchvision's ResNet-18 block: two 3x3 convolutions, a projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


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


def mlp(modules: int) -> Callable[[], tuple[nn.Module, Callable[[], Any]]]:
    """``modules`` small leaf modules: Linear(64, 64) and ReLU alternating, batch 32."""

    def build() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        layers: list[nn.Module] = []
        for _ in range(modules // 2):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        model = nn.Sequential(*layers[:-1], nn.Linear(64, 10))
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        return model, lambda: (x, y)

    return build


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
        started = CLOCK()
        with self.context():
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
        self.optimizer.step()
        self.after(loss)
        return CLOCK() - started


class Breakpod(Setup):
    def __init__(self, model: nn.Module, check_every: int, enabled: bool = True) -> None:
        super().__init__(model)
        os.environ["BREAKPOD_MONITOR"] = "1" if enabled else "0"
        # the detailed tier (per-module hooks); the default sentinel tier: bench/sentinel.py
        self.monitor = breakpod.watch(model, check_every=check_every, tier="detailed")
        os.environ.pop("BREAKPOD_MONITOR")
        self.name = (
            f"breakpod detailed tier, check_every={check_every}" if enabled else "breakpod disabled"
        )
        self.key = f"check_every={check_every}" if enabled else "disabled"

    def after(self, loss: torch.Tensor) -> None:
        self.monitor.step(loss)
        self.reads = self.monitor.reads


class Without(Breakpod):
    """The default rules at check_every=1 less one check, to show what that check costs:
    the flight recorder (``BREAKPOD_FLIGHT_STEPS=0``), or the per-module input-gradient
    checks (``nonfinite`` with ``where: [activation, param, loss]``: gradients are then
    judged by their parameters' norms only)."""

    def __init__(self, model: nn.Module, key: str) -> None:
        Setup.__init__(self, model)
        self.name, self.key = WITHOUT[key], key
        from breakpod._monitor.flight.recorder import FLIGHT_ENV  # not at import: see peak_rss

        rules = None
        if key == "no input grads":
            rules = [{"name": "nonfinite", "check": "nonfinite", "where": NO_INPUT_GRADS}]
        else:
            os.environ[FLIGHT_ENV] = "0"
        self.monitor = breakpod.watch(model, rules, check_every=1, tier="detailed")
        os.environ.pop(FLIGHT_ENV, None)


NO_INPUT_GRADS = ["activation", "param", "loss"]
WITHOUT = {
    "no flight": "breakpod, flight recorder off",
    "no input grads": "breakpod, no input-gradient checks",
}


class BreakRule(Breakpod):
    """A ``break`` rule: each step is judged in the optimizer's pre-hook, one read per step."""

    name = "breakpod + a break rule, check_every=10"
    key = "break rule"

    def __init__(self, model: nn.Module) -> None:
        Setup.__init__(self, model)
        rules = [{"name": "nan-break", "check": "nonfinite", "action": "break"}]
        self.monitor = breakpod.watch(
            model, rules, optimizer=self.optimizer, check_every=10, tier="detailed"
        )


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


class DeviceFlags(Setup):
    """The anchor: forward hooks write isfinite flags into one device tensor, read once a step."""

    name = "hand-written device-flag hooks"
    key = "device flags"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        leaves = [m for m in model.modules() if not list(m.children())]
        self.flags = torch.ones(len(leaves), dtype=torch.bool)
        for i, module in enumerate(leaves):
            module.register_forward_hook(self._hook(self.flags[i]))

    @staticmethod
    def _hook(flag: torch.Tensor) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                torch.all(torch.isfinite(output), out=flag)

        return hook

    def after(self, loss: torch.Tensor) -> None:
        self.reads += 1
        if not bool(self.flags.all()):
            print("non-finite activation")


class HookFloor(Setup):
    """What any per-module check of outputs and input gradients pays before it computes
    anything: an empty forward hook per leaf module, which puts an empty pre-hook on the
    node that made the module's input (called in backward with that input's gradient)."""

    name = "empty hooks (forward + input-gradient pre-hook)"
    key = "hook floor"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for module in model.modules():
            if not list(module.children()):
                module.register_forward_hook(self._hook)

    @staticmethod
    def _hook(module: nn.Module, inputs: Any, output: Any) -> None:
        x = inputs[0] if inputs else None
        if isinstance(x, torch.Tensor) and x.grad_fn is not None:
            x.grad_fn.register_prehook(_nothing)


def _nothing(grad_outputs: Any) -> None:
    return None


ALL_DIMS = [tuple(range(n)) for n in range(9)]  # a tensor's sum as a reduction over dims


class CoverageFloor(Setup):
    """The leanest hooks that read what breakpod's default non-finite rule reads: every
    leaf module's output and the gradient w.r.t. its input, each summed into its own
    element of one device tensor (a NaN or an infinity carries into its sum: one kernel
    per tensor), read once a step. No norms, dead units, parameters, loss, flight
    recorder or bookkeeping: a lower bound on the default rules' cost, whoever writes
    them (float32 models, as the bench's)."""

    name = "hand-written hooks, breakpod's coverage"
    key = "coverage floor"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        leaves = [m for m in model.modules() if not list(m.children())]
        self.sums = torch.zeros(2 * len(leaves))
        for i, module in enumerate(leaves):
            module.register_forward_hook(self._hook(self.sums[2 * i], self.sums[2 * i + 1]))

    @staticmethod
    def _hook(out_sum: torch.Tensor, grad_sum: torch.Tensor) -> Callable[..., None]:
        def on_grad(grads: Any) -> None:
            if grads[0] is not None:
                torch.sum(grads[0], ALL_DIMS[grads[0].dim()], out=grad_sum)

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                torch.sum(output.detach(), ALL_DIMS[output.dim()], out=out_sum)
            x = inputs[0] if inputs else None
            if isinstance(x, torch.Tensor) and x.grad_fn is not None:
                x.grad_fn.register_prehook(on_grad)

        return hook

    def after(self, loss: torch.Tensor) -> None:
        self.reads += 1
        if not bool(torch.isfinite(self.sums).all()):
            print("non-finite activation or input gradient")


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
    model = _fresh(build)
    yield Setup(model())
    yield Breakpod(model(), 1, enabled=False)
    yield Breakpod(model(), 1)
    yield Breakpod(model(), 10)
    yield Without(model(), "no flight")
    yield Without(model(), "no input grads")
    yield BreakRule(model())
    yield DeviceFlags(model())
    yield CoverageFloor(model())
    yield ItemChecks(model())
    yield DetectAnomaly(model())


def mlp_setups(build: Callable[[], Any]) -> Iterator[Setup]:
    model = _fresh(build)
    yield Setup(model())
    yield Breakpod(model(), 1)
    yield Breakpod(model(), 10)
    yield Without(model(), "no flight")
    yield Without(model(), "no input grads")
    yield DeviceFlags(model())
    yield CoverageFloor(model())
    yield HookFloor(model())


def _fresh(build: Callable[[], Any]) -> Callable[[], nn.Module]:
    """A maker of the same model (same seed) for each setup."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        made: nn.Module = build()[0]
        return made

    return model


Result = tuple[Setup, float, float]


def measure(
    build: Callable[[], Any],
    rounds: int,
    per_round: int,
    warmup: int,
    make: Callable[[Callable[[], Any]], Iterator[Setup]] = setups,
    base_time: list[float] | None = None,
    blocks: int = 1,
) -> list[Result]:
    """Per setup: median over rounds of its step time / the baseline's that round; reads/step.

    Within a round each setup's fastest of ``per_round`` steps is taken: other
    processes on a shared machine only ever add time, and do so to every setup.
    With ``blocks``, the rounds are split among that many fresh sets of setups (new
    copies of the model, new monitors): each copy's own speed (where its memory
    landed: two unmonitored copies differ by a hundredth or more here) is then one
    more draw that the median takes in, not a bias of the whole run.
    """
    data = build()[1]
    ratios: dict[int, list[float]] = {}
    reads: dict[int, float] = {}
    runs: list[Setup] = []
    for block in range(blocks):
        runs = list(make(build))
        with _quiet_warnings():
            for s in runs:
                for _ in range(warmup):
                    s.step(*data())
                _reset_reads(s)
            for r in range(block, rounds, blocks):
                times = {}
                for s in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    times[id(s)] = min(s.step(*data()) for _ in range(per_round))
                for i, s in enumerate(runs):
                    ratios.setdefault(i, []).append(times[id(s)] / times[id(runs[0])])
                if base_time is not None:
                    base_time.append(times[id(runs[0])])
        for i, s in enumerate(runs):
            reads[i] = reads.get(i, 0) + s.reads
    steps = rounds * per_round
    return [(s, statistics.median(ratios[i]), reads[i] / steps) for i, s in enumerate(runs)]


def _reset_reads(s: Setup) -> None:
    s.reads = 0
    if isinstance(s, Breakpod):
        s.monitor.reads = 0


@contextlib.contextmanager
def stderr_to_devnull() -> Iterator[None]:
    """The process's fd 2 to /dev/null for a while: breakpod and torch's profiler write to
    the real stderr, past ``sys.stderr``."""
    if sys.__stderr__ is not None:
        sys.__stderr__.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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


def measure_mlps(rounds: int, sizes: tuple[int, ...] = MLP_SIZES) -> list[str]:
    """One row per MLP size: ratios and added µs per module per step, next to the anchor."""
    header = f"{'MLP modules':>11}{'base ms/step':>14}" + "".join(
        f"{k + ' ratio':>22}{'µs/module':>11}" for k in MLP_KEYS
    )
    lines = [header, "-" * len(header)]
    for n in sizes:
        base: list[float] = []
        rows = measure(mlp(n), rounds, 3, warmup=3, make=mlp_setups, base_time=base)
        base_s = statistics.median(base)
        row = f"{n:>11}{base_s * 1e3:>14.2f}"
        for setup, ratio, _ in rows[1:]:
            per_module = (ratio - 1) * base_s / n * 1e6
            row += f"{ratio:>21.3f}x{per_module:>11.1f}"
            MLP_RESULTS[(n, getattr(setup, "key", ""))] = (ratio, per_module)
        lines.append(row)
    return lines


MLP_KEYS = (
    "check_every=1", "check_every=10", "no flight", "no input grads", "device flags",
    "coverage floor", "hook floor",
)  # fmt: skip
MLP_RESULTS: dict[tuple[int, str], tuple[float, float]] = {}


def mlp_verdicts() -> list[str]:
    out = []
    for n in (200, 800):
        if (n, "check_every=1") not in MLP_RESULTS:
            continue
        ratio, per_module = MLP_RESULTS[(n, "check_every=1")]
        anchor = MLP_RESULTS[(n, "device flags")][0]
        floor = MLP_RESULTS[(n, "hook floor")][1]
        coverage = MLP_RESULTS[(n, "coverage floor")][1]
        ok = "ok" if ratio <= anchor and per_module <= MLP_PER_MODULE_US else "MISSED"
        out.append(
            f"mlp{n}: check_every=1 {ratio:.3f}x, {per_module:.1f} µs/module (target <= the "
            f"hand-written hooks' {anchor:.3f}x and <= {MLP_PER_MODULE_US:g} µs; the same "
            f"coverage hand-written {coverage:.1f} µs, empty hooks alone {floor:.1f} µs) {ok}"
        )
    return out


class CollectorTime:
    """Time spent in the garbage collector, and its full collections, while active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __enter__(self) -> CollectorTime:
        gc.collect()  # each setup starts with no garbage pending in any generation
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2


def collector_per_step(n: int = 800, steps: int = 150) -> list[str]:
    """Each MLP setup alone for ``steps`` steps: the collector's share of a step.

    The ratios above take each setup's fastest steps, which leaves out the rare
    long pauses of full collections (a pass over every object of a process that
    imported torch); this counts them."""
    build = mlp(n)
    data = build()[1]
    runs = list(mlp_setups(build))
    title = f"setup (MLP, {n} modules)"
    header = f"{title:<48}{'gc ms/step':>12}{'full gc/100 steps':>19}"
    lines = [header, "-" * len(header)]
    with _quiet_warnings():
        for s in runs:
            for _ in range(3):
                s.step(*data())
            with CollectorTime() as spent:
                for _ in range(steps):
                    s.step(*data())
            per_step = spent.seconds / steps * 1e3
            lines.append(f"{s.name:<48}{per_step:>12.2f}{spent.full * 100 / steps:>19.1f}")
    return lines


RSS_MODELS: dict[str, Callable[[], Any]] = {"transformer": transformer, "mlp800": mlp(800)}
RSS_SETUPS = ("baseline", "check_every=1", "check_every=10", "device flags")


def one_setup(model_name: str, key: str) -> Setup:
    torch.manual_seed(0)
    model = RSS_MODELS[model_name]()[0]
    if key == "baseline":
        return Setup(model)
    if key == "device flags":
        return DeviceFlags(model)
    return Breakpod(model, int(key.partition("=")[2]))


def peak_rss_child(model_name: str, key: str, steps: int) -> None:
    """Run in a fresh process: train ``steps`` steps, print the peak RSS in MiB."""
    torch.set_num_threads(1)
    setup = one_setup(model_name, key)
    data = RSS_MODELS[model_name]()[1]
    with _quiet_warnings():
        for _ in range(steps):
            setup.step(*data())
    print(_peak_rss_mib())


def _peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM (``ru_maxrss`` would keep the forking parent's peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss(steps: int) -> list[str]:
    """Peak RSS per setup, each in its own process (the peak is a process-wide maximum).
    The baseline's process never imports breakpod's monitor: its imports count against it."""
    lines = [f"{'model':<12}" + "".join(f"{k:>18}" for k in RSS_SETUPS) + "   (peak RSS, MiB)"]
    for model_name in RSS_MODELS:
        peaks = {}
        for key in RSS_SETUPS:
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", model_name, key, str(steps)],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            peaks[key] = float(out.stdout.split()[-1])
        base = peaks["baseline"]
        row = f"{model_name:<12}"
        for key in RSS_SETUPS:
            row += f"{peaks[key]:>10.0f} ({peaks[key] / base:.3f})"
        worst = max(peaks[k] for k in RSS_SETUPS if k.startswith("check_every"))
        ok = "ok" if worst <= base * RSS_SLACK else "MISSED"
        lines.append(f"{row}   monitors <= baseline + 5%: {ok}")
    return lines


# Ops that only make a view or metadata: no kernel on a GPU.
NO_KERNEL = {
    "aten::detach", "aten::alias", "aten::view", "aten::select", "aten::slice", "aten::unbind",
    "aten::as_strided", "aten::expand", "aten::t", "aten::reshape", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::detach_", "aten::flatten",
}  # fmt: skip


def launches(events: Any) -> list[Any]:
    """Outermost torch ops (forward, and backward under autograd's nodes) that run a kernel:
    not a ``to`` that had nothing to convert, nor breakpod's judgement on host copies."""
    from breakpod._monitor.monitor import JUDGE_LABEL  # not at import: see peak_rss

    return [
        e
        for e in events
        if e.name.startswith("aten::")
        and e.name not in NO_KERNEL
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        and not (e.name == "aten::to" and not e.cpu_children)
        and not _under(e, JUDGE_LABEL)
    ]


def _under(event: Any, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None and parent.name != label:
        parent = parent.cpu_parent
    return parent is not None


def ops_per_step(sizes: tuple[int, ...] = (200, 800), steps: int = 3) -> list[str]:
    """Torch ops that launch a kernel (on a GPU) per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    lines = [f"{'MLP modules':>11}" + "".join(f"{k:>18}" for k in ("baseline", *MLP_KEYS))]
    for n in sizes:
        counts = []
        for setup in mlp_setups(mlp(n)):
            data = mlp(n)()[1]
            for _ in range(3):
                setup.step(*data())
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    setup.step(*data())
            top = launches(prof.events())
            counts.append(len(top) / steps)
        added = [c - counts[0] for c in counts]
        lines.append(
            f"{n:>11}{counts[0]:>18.0f}"
            + "".join(f"{a:>+11.0f} ({a / n:.2f}/m)" for a in added[1:])
        )
    return lines


def cuda_check(steps: int = 20) -> list[str]:
    """On CUDA: ratios at check_every=1 and 10 with log/event rules, and no host sync per step.

    ``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising
    call, so a monitored step that completes made none (the host reads are
    non-blocking copies, evaluated once their event reports them landed).
    """
    builds = {"mlp200": mlp(200), "mlp800": mlp(800), "resnet": resnet, "transformer": transformer}
    lines = [f"{'model':<12}{'base ms/step':>14}{'check_every=1':>15}{'check_every=10':>16}"]
    for name, build in builds.items():
        torch.manual_seed(0)
        x, y = (t.cuda() for t in build()[1]())
        runs = {}
        for key in ("baseline", "check_every=1", "check_every=10"):
            torch.manual_seed(0)
            model = build()[0].cuda()
            every = int(key.partition("=")[2] or 0)
            runs[key] = Breakpod(model, every) if every else Setup(model)
        for setup in runs.values():  # warm-up: allocator, cuDNN, lazy buffers
            for _ in range(3):
                setup.step(x, y)
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {k: [] for k in runs}
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                for key, setup in runs.items():
                    times[key].append(_cuda_step(setup, x, y))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for key, setup in runs.items():
            if isinstance(setup, Breakpod):
                setup.monitor.flush()
                assert setup.monitor.errors == 0, f"{name} {key}: monitor errors"
        base = statistics.median(times["baseline"])
        ratio = {k: statistics.median(v) / base for k, v in times.items()}
        lines.append(
            f"{name:<12}{base * 1e3:>14.2f}{ratio['check_every=1']:>14.3f}x"
            f"{ratio['check_every=10']:>15.3f}x"
        )
    lines.append("no host sync in any monitored step (sync debug mode 'error'): ok")
    return lines


def _cuda_step(setup: Setup, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step timed with CUDA events (reading them afterwards, outside sync-debug)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    setup.step(x, y)
    end.record()
    torch.cuda.set_sync_debug_mode(0)
    end.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    return float(start.elapsed_time(end)) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (CNN)")
    parser.add_argument("--steps", type=int, default=3, help="steps of each setup per round (CNN)")
    parser.add_argument("--quick", action="store_true", help="MLPs, ops and memory only")
    parser.add_argument("--cuda", action="store_true", help="the CUDA table and sync check")
    parser.add_argument("--cpu-time", action="store_true", help="time steps by thread CPU time")
    parser.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.thread_time
    if args.cuda:
        print("\n".join(cuda_check()))
        return 0
    if args.rss_child:
        peak_rss_child(args.rss_child[0], args.rss_child[1], int(args.rss_child[2]))
        return 0
    torch.set_num_threads(1)
    big_rounds = max(3, 2 * args.rounds // 3)
    if not args.quick:
        results = {
            "resnet": measure(resnet, args.rounds, args.steps, warmup=3),
            "transformer": measure(transformer, big_rounds, 1, warmup=2),
        }
        print(
            f"torch {torch.__version__}, CPU, 1 thread; ratio = median over interleaved rounds "
            f"of step time / baseline step time in the same round (CNN: {args.rounds} rounds, "
            f"best of {args.steps} steps each; transformer: {big_rounds} rounds of 1 step; "
            "after warm-up)"
        )
        print(table(results))
        print("\n".join(verdicts(results)))
    print(f"\nMLPs of small Linear(64)+ReLU modules, batch 32 ({big_rounds} rounds, best of 3)")
    print("\n".join(measure_mlps(big_rounds)))
    print("\n".join(mlp_verdicts()))
    print("\ngarbage collection, each setup alone (the ratios above leave its pauses out)")
    print("\n".join(collector_per_step()))
    print("\nkernel launches per step (torch ops that run one, from the profiler), added")
    print("\n".join(ops_per_step()))
    print("\npeak resident memory, one process per setup (ratio to the baseline)")
    print("\n".join(peak_rss(steps=40)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
