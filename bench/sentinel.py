"""The sentinel tier's cost on CPU training steps, next to its anchor, and its replay time.

The anchor is the naive sentinel a careful user would write: ``isfinite`` of the
loss and ``torch._foreach_norm`` of every gradient, into one tensor read once a
step (GradScaler's price: one host read per step). breakpod's sentinel tier
(``watch(model, optimizer=opt)``, the default) does that plus the rules: the
gradient-norm baselines per module, the loss spike, BatchNorm's running
statistics, the flight recorder's loss and the step capture a replay needs. The
detailed tier (per-module hooks, ``tier="detailed"``) is ``bench/monitors.py``'s
subject; one row of it here for scale.

Models: the small CNN and the transformer of ``bench/monitors.py``, a ResNet-18 written
out (torchvision's architecture; its wheels here are CUDA builds that do not load
against the CPU torch), batch 16 x 3x64x64, and MLPs of 200 and 800 small Linear+ReLU
modules. Setups run interleaved, round after round; each ratio is the median over rounds
of a setup's step time over the baseline's in the same round (the fastest of the round's
steps each). The rounds are split among four fresh sets of model copies and monitors: a
copy's own speed (where its memory landed) is then a draw the median takes in, not a
bias of the whole run. Then, per model, the time from a trigger (a NaN written into the
first layer's weight) to the localized report: the replay under the detailed checks.
Then, from ``torch.profiler``, the torch ops per step that run a kernel (the launches on
a GPU) and the host reads per step, next to GradScaler's (``torch.amp.GradScaler``: one
fused non-finite check and one read a step), and the peak RSS of a process training with
tier 1 next to one without (each in its own process: the peak is a process-wide
maximum), with its private part apart, also against a baseline with breakpod's modules
loaded. Last, a ``skip`` rule on gradient spikes at ``check_every=10``: decided on the
device with a fused Adam, read before each update with a foreach one, next to
GradScaler.

    python bench/sentinel.py [--rounds N] [--quick] [--cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from monitors import (  # bench/
    Block,
    Setup,
    _peak_rss_mib,
    _quiet_warnings,
    launches,
    measure,
    mlp,
    resnet,
    stderr_to_devnull,
    transformer,
)
from torch import nn

import breakpod

TIER1_TARGET = 1.02  # CNN, transformer, ResNet-18: tier 1 at check_every=1
MLP_SLACK = 0.02  # MLPs: tier 1 at most the naive sentinel's ratio + this
RSS_TARGET = 1.02  # peak RSS with tier 1 at most the baseline's + 2%
BLOCKS = 4  # fresh copies of the models and monitors, each for a quarter of the rounds
WARMUP = 6  # steps per setup before a block's rounds: past the baselines' warm-up (5)
SYNCING = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")  # host reads


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for i, (c_in, c_out, stride) in enumerate(widths, 1):
            blocks = nn.Sequential(Block(c_in, c_out, stride), Block(c_out, c_out, 1))
            setattr(self, f"layer{i}", blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return ResNet18(), lambda: (x, y)


class NaiveSentinel(Setup):
    """The anchor: the loss's isfinite and every gradient's norm, one read a step."""

    name = "naive sentinel (isfinite + _foreach_norm)"
    key = "naive"

    def after(self, loss: torch.Tensor) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norms = torch._foreach_norm(grads)
        flags = torch.cat([torch.stack(norms), loss.detach().reshape(1)])
        self.reads += 1
        if not bool(torch.isfinite(flags).all()):
            raise RuntimeError("the bench's model went non-finite")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        started = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.after(loss)  # before the update, as GradScaler reads
        self.optimizer.step()
        return time.perf_counter() - started


class Scaler(Setup):
    """GradScaler's price: a fused non-finite check of the gradients, one read a step."""

    name = "GradScaler"
    key = "scaler"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        started = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return time.perf_counter() - started


class Control(Setup):
    """The baseline again, on a model of its own: the table's noise floor. Each setup trains
    its own copy of the model, and two unmonitored copies differ by about a hundredth
    here (where the memory of each lands, what else the machine runs)."""

    name = "baseline, another copy"
    key = "control"


class Tier(Setup):
    """``watch(model, optimizer=opt)``: the step judged at the optimizer's pre-hook."""

    def __init__(
        self, model: nn.Module, tier: str, check_every: int, rules: Any = None, adam: str = ""
    ) -> None:
        self._counted = 0  # the monitor's reads before the count was last reset
        super().__init__(model)
        if adam:
            self.optimizer = adam_of(model, adam)
        self.monitor = breakpod.watch(
            model, rules, optimizer=self.optimizer, check_every=check_every, tier=tier
        )
        self.key = f"{tier} {check_every}"
        self.name = f"breakpod {tier} tier, check_every={check_every}"

    @property
    def reads(self) -> int:
        return self.monitor.reads - self._counted

    @reads.setter
    def reads(self, value: int) -> None:  # the bench resets it after the warm-up
        monitor = getattr(self, "monitor", None)
        self._counted = (monitor.reads if monitor is not None else 0) - value

    def after(self, loss: torch.Tensor) -> None:
        self.monitor.step(loss)


def seeded(build: Callable[[], Any]) -> nn.Module:
    """A fresh copy of the model, the same weights for every setup."""
    torch.manual_seed(0)
    made: nn.Module = build()[0]
    return made


def sentinel_setups(detailed: bool) -> Callable[[Callable[[], Any]], Any]:
    def make(build: Callable[[], Any]) -> Any:
        def model() -> nn.Module:
            return seeded(build)

        yield Setup(model())
        yield Control(model())
        yield NaiveSentinel(model())
        yield Tier(model(), "sentinel", 1)
        yield Tier(model(), "sentinel", 10)
        if detailed:
            yield Tier(model(), "detailed", 1)

    return make


MODELS: dict[str, tuple[Callable[[], Any], bool]] = {
    "cnn": (resnet, True),
    "transformer": (transformer, True),
    "resnet18": (resnet18, True),
    "mlp200": (mlp(200), False),
    "mlp800": (mlp(800), False),
}


def cost(rounds: int, names: list[str]) -> list[str]:
    header = (
        f"{'model':<12}{'control':>10}{'naive':>10}{'tier 1, 1':>12}{'tier 1, 10':>12}"
        f"{'tier 2, 1':>12}"
    )
    lines = [header, "-" * len(header)]
    verdicts = []
    for name in names:
        build, detailed = MODELS[name]
        big = name in ("transformer", "resnet18")  # the fastest of 2 steps a round, not of 3
        steps = 2 if big else 3
        rows = measure(build, rounds, steps, WARMUP, sentinel_setups(detailed), blocks=BLOCKS)
        ratio = {getattr(s, "key", ""): r for s, r, _ in rows}
        reads = {getattr(s, "key", ""): n for s, _, n in rows}
        tier2 = f"{ratio['detailed 1']:>11.3f}x" if detailed else f"{'-':>12}"
        lines.append(
            f"{name:<12}{ratio['control']:>9.3f}x{ratio['naive']:>9.3f}x"
            f"{ratio['sentinel 1']:>11.3f}x{ratio['sentinel 10']:>11.3f}x{tier2}"
            f"   (host reads/step {reads['sentinel 1']:.1f}, {reads['sentinel 10']:.2f} at 10)"
        )
        target = ratio["naive"] + MLP_SLACK if name.startswith("mlp") else TIER1_TARGET
        said = f"naive {ratio['naive']:.3f}x + {MLP_SLACK}" if name.startswith("mlp") else ""
        ok = "ok" if ratio["sentinel 1"] <= target else "MISSED"
        verdicts.append(
            f"{name}: tier 1 at check_every=1 {ratio['sentinel 1']:.3f}x "
            f"(target <= {target:.3f}x{' = ' + said if said else ''}) {ok}"
        )
    return lines + verdicts


def replay_time(build: Callable[[], Any]) -> tuple[float, str]:
    """Seconds from the trigger to the localized report, and what it named."""
    torch.manual_seed(0)
    model, data = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = breakpod.watch(model, optimizer=optimizer, tier="sentinel", sink=lambda a: None)
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                first.weight.view(-1)[0] = float("nan")
        x, y = data()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(loss)
    monitor.close()
    found = [a for a in monitor.anomalies if a.check == "nonfinite"]
    said = f"{found[0].phase} {found[0].module} ({found[0].how})" if found else "nothing"
    return (monitor.replay_seconds or [float("nan")])[0], said


def replay_times(names: list[str]) -> list[str]:
    lines = [f"{'model':<12}{'replay s':>10}  localized"]
    for name in names:
        with _quiet_warnings(), stderr_to_devnull():  # the anomalies' log lines: the table has them
            seconds, said = replay_time(MODELS[name][0])
        lines.append(f"{name:<12}{seconds:>10.3f}  {said}")
    return lines


def counted_setups(build: Callable[[], Any]) -> list[Setup]:
    def model() -> nn.Module:
        return seeded(build)

    tiers = [Tier(model(), "sentinel", 1), Tier(model(), "sentinel", 10)]
    return [Setup(model()), Scaler(model()), NaiveSentinel(model()), *tiers]


def per_step_counts(names: list[str], steps: int = 10) -> list[str]:
    """Per step, from the profiler: the torch ops that run a kernel (added over the
    baseline), the ops that read a value to the host (``item``, ``is_nonzero``), and
    breakpod's reads of its flags (non-blocking copies, judged once landed). On a CPU
    the sentinel also looks at the gradient norms at the end of each backward (a read
    of host memory there; on a GPU it is not made: see sentinel.py)."""
    from torch.profiler import ProfilerActivity, profile

    lines = [f"{'model':<12}{'setup':<14}{'ops added':>10}{'host reads':>12}{'flag reads':>12}"]
    for name in names:
        build = MODELS[name][0]
        data = build()[1]
        base = 0.0
        for setup in counted_setups(build):
            with _quiet_warnings():
                for _ in range(3):
                    setup.step(*data())
                flags = setup.monitor.reads if isinstance(setup, Tier) else 0
                with stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(steps):  # (torch's profiler says its stop on stderr)
                        setup.step(*data())
            top = launches(prof.events())
            ops, synced = len(top) / steps, sum(e.name in SYNCING for e in top) / steps
            base = base or ops
            if isinstance(setup, Tier):
                said = f"{(setup.monitor.reads - flags) / steps:>12.1f}"
            else:
                said = f"{'-':>12}"
            key = getattr(setup, "key", "baseline")
            added = f"{ops:>10.0f}" if key == "baseline" else f"{ops - base:>+10.0f}"
            lines.append(f"{name:<12}{key:<14}{added}{synced:>12.1f}{said}")
    return lines


def adam_of(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-4, **{kind: True})


class Adam(Setup):
    """The skip rule's baseline: Adam, fused (it takes ``found_inf``) or foreach."""

    def __init__(self, model: nn.Module, kind: str = "fused") -> None:
        super().__init__(model)
        self.optimizer = adam_of(model, kind)
        self.key = f"adam {kind}"


class AdamScaler(Scaler):
    """GradScaler over the fused Adam: its found_inf handed to the fused kernel."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.optimizer = adam_of(model, "fused")


SPIKES = {"name": "spikes", "check": "grad_norm", "action": ["log", "skip"]}


class SkipRule(Tier):
    """A gradient-spike ``skip`` rule at check_every=10: on the device with a fused
    optimizer (no read before each update), on the host with a foreach one (a read a step)."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__(model, "sentinel", 10, rules=[SPIKES], adam=kind)
        self.key = f"skip {kind}"

    def spike_dropped(self, data: Callable[[], Any]) -> bool:
        """Train a step whose gradients are 1000x: was its update dropped?"""
        x, y = data()
        before = [p.detach().clone() for p in self.model.parameters()]
        loss = nn.functional.cross_entropy(self.model(x), y) * 1000.0
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.monitor.step(loss)
        return all(torch.equal(b, p) for b, p in zip(before, self.model.parameters(), strict=True))


def skip_rule_setups(build: Callable[[], Any]) -> Any:
    yield Adam(seeded(build))  # the baseline
    yield AdamScaler(seeded(build))
    yield SkipRule(seeded(build), "fused")
    yield Adam(seeded(build), "foreach")  # what the foreach optimizer costs by itself
    yield SkipRule(seeded(build), "foreach")


def skip_rule(rounds: int, names: list[str]) -> list[str]:
    """A ``skip`` rule on gradient spikes: step time over unmonitored fused Adam (the
    foreach Adam's own cost in a row of its own), breakpod's reads per step (each one
    waited for before the update with the foreach Adam), and whether a 1000x spike's
    update was dropped; next to GradScaler, which with a fused optimizer also hands
    found_inf to the kernel and reads nothing before the update."""
    lines = [f"{'model':<12}{'setup':<14}{'ratio':>8}{'reads/step':>12}  1000x spike"]
    for name in names:
        build = MODELS[name][0]
        rows = measure(build, rounds, 3, warmup=12, make=skip_rule_setups)
        data = build()[1]
        for setup, ratio, reads in rows[1:]:
            dropped = "-"
            if isinstance(setup, SkipRule):
                with _hushed():  # an anomaly line per module's group, at the step or the read
                    dropped = "dropped" if setup.spike_dropped(data) else "APPLIED"
                    setup.monitor.close()
            lines.append(f"{name:<12}{setup.key:<14}{ratio:>7.3f}x{reads:>12.2f}  {dropped}")
    return lines


@contextlib.contextmanager
def _hushed() -> Any:
    """breakpod's lines go to the real stderr (sys.__stderr__): sent elsewhere meanwhile."""
    real, sys.__stderr__ = sys.__stderr__, io.StringIO()
    try:
        yield
    finally:
        sys.__stderr__ = real


RSS_MODELS = ("transformer", "resnet18", "mlp800")
SKIP_MODELS = ("cnn", "mlp200")


def rss_child(name: str, key: str, steps: int) -> None:
    """In a fresh process: ``steps`` steps of one setup; prints its peak RSS and its peak
    private memory (anonymous pages: the heap, tensors, Python objects), in MiB."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build = MODELS[name][0]
    model, data = build()
    if key == "loaded":  # breakpod's modules loaded (a watch of a tiny model, closed)
        breakpod.watch(nn.Linear(1, 1)).close()
    setup = Tier(model, "sentinel", 1) if key == "sentinel" else Setup(model)
    private = 0.0
    with _quiet_warnings():
        for _ in range(steps):
            setup.step(*data())
            private = max(private, _status_mib("RssAnon"))
    print(_peak_rss_mib(), private)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return math.nan


def peak_rss(steps: int = 30) -> list[str]:
    """Peak RSS with tier 1 over without, and its private part (anonymous pages) apart:
    over the bare baseline, and over one with breakpod's modules loaded (what the
    monitor's data costs alone). The rest of RSS is file pages, mostly the code of the
    torch kernels the monitor's ops run: shared by every process that maps the library,
    and given back under memory pressure."""
    lines = [
        f"{'model':<12}{'baseline MiB':>14}{'tier 1 MiB':>12}{'ratio':>8}"
        f"{'private':>10}{'private, loaded':>17}   peak RSS against the target"
    ]
    for name in RSS_MODELS:
        peaks = {}
        for key in ("baseline", "loaded", "sentinel"):
            argv = [sys.executable, __file__, "--rss-child", name, key, str(steps)]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
            peaks[key] = [float(v) for v in out.stdout.split()[-2:]]
        (base, private), (_, loaded), (tier, tier_private) = peaks.values()
        ratio = tier / base
        ok = "ok" if ratio <= RSS_TARGET else "MISSED"
        lines.append(
            f"{name:<12}{base:>14.0f}{tier:>12.0f}{ratio:>7.3f}x{tier_private / private:>9.3f}x"
            f"{tier_private / loaded:>16.3f}x   <= {RSS_TARGET}x: {ok}"
        )
    return lines


def cuda_check(steps: int = 20) -> list[str]:
    """On CUDA: the sentinel's host syncs per step, counted under sync-debug ``warn``
    (``error`` would forbid the one read it is allowed): at most one a step at
    check_every=1, none on the steps between reads at check_every=10."""
    lines = [f"{'model':<12}{'check_every':>12}{'syncs/step (max)':>18}{'between reads':>15}"]
    for name, (build, _) in MODELS.items():
        for every in (1, 10):
            torch.manual_seed(0)
            model, data = build()
            model = model.cuda()
            x, y = (t.cuda() for t in data())
            setup = Tier(model, "sentinel", every)
            for _ in range(3):
                setup.step(x, y)
            torch.cuda.synchronize()
            counts = []
            for _ in range(steps):
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        setup.step(x, y)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = sum("synchroniz" in str(w.message) for w in seen)
                counts.append((setup.monitor.step_count, syncs))
            worst = max(c for _, c in counts)
            between = max((c for n, c in counts if n % every), default=0)
            assert worst <= 1, f"{name} check_every={every}: {worst} host syncs in a step"
            assert every == 1 or between == 0, f"{name}: {between} syncs between reads"
            assert setup.monitor.errors == 0, f"{name}: monitor errors"
            lines.append(f"{name:<12}{every:>12}{worst:>18}{between:>15}")
            setup.monitor.close()
    lines.append("tier 1: at most one host sync per step, none between reads: ok")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="the MLPs only")
    parser.add_argument("--cuda", action="store_true", help="the CUDA sync check")
    parser.add_argument("--models", default="", help="comma list (default: all)")
    parser.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child[0], args.rss_child[1], int(args.rss_child[2]))
        return 0
    if args.cuda:
        print("\n".join(cuda_check()))
        return 0
    torch.set_num_threads(1)
    names = [n for n in args.models.split(",") if n] or list(MODELS)
    if args.quick:
        names = [n for n in names if n.startswith("mlp")]
    print(
        f"torch {torch.__version__}, CPU, 1 thread; ratio = median over {args.rounds} interleaved "
        f"rounds ({BLOCKS} sets of fresh copies) of step time / baseline step time in the same "
        "round; control: an unmonitored copy of the model, the noise floor"
    )
    print("\n".join(cost(args.rounds, names)))
    print("\ntime from a trigger to the localized report (the replay under the detailed checks)")
    print("\n".join(replay_times(names)))
    print("\nper step, from the profiler: torch ops that run a kernel (the launches on a GPU;")
    print("the baseline's, then what each setup adds), host reads, breakpod's flag reads")
    print("\n".join(per_step_counts(names)))
    print("\na skip rule on gradient spikes (check_every=10), next to GradScaler: fused Adam")
    print("decides on the device, foreach Adam reads before each update")
    print("\n".join(skip_rule(max(args.rounds // 2, 4), [n for n in names if n in SKIP_MODELS])))
    print("\npeak RSS, each setup in its own process")
    print("\n".join(peak_rss()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
