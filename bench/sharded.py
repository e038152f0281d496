"""The sentinel tier's cost in a sharded job: FSDP2 (``fully_shard``), two ranks under
torchrun, gloo, CPU, 1 thread each.

What it adds under FSDP is one all-reduce a step of a float64 per parameter (the
shards' squared gradient norms summed, so every rank judges the full norms alike).
The anchor is what an FSDP2 user writes for the same knowledge: the total gradient
norm as ``clip_grad_norm_`` takes it (``torch.nn.utils.get_total_norm`` of the
DTensor gradients, ``full_tensor()``: one all-reduce), read once a step. Setups run
interleaved, round after round, on one model (a skip rule adds the ranks' agreement
at each update, one more all-reduce); each ratio is the median over rounds
of a setup's step time over the unmonitored one's in the same round (the fastest of
the round's steps each), as rank 0 times them.

    python bench/sharded.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LAYERS, WIDTH, BATCH, STEPS = 24, 256, 32, 16
SETUPS = ("none", "naive", "tier 1 @1", "tier 1 @10", "skip @1")
SKIP = [{"name": "spikes", "check": "grad_norm", "action": ["log", "skip"]}]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return rank_main(args.rounds)
    cmd = [str(TORCHRUN), "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    cmd += ["--master-port=29671", __file__, f"--rounds={args.rounds}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, env=env, capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        print(f"the sharded bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.returncode


def rank_main(rounds: int) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, opt = sharded_mlp()
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    for _ in range(rounds):
        for name in SETUPS:
            times[name].append(fastest_step(name, model, opt))
    if dist.get_rank() == 0:
        report(times, rounds, sum(1 for _ in model.parameters()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def sharded_mlp() -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)


def fastest_step(name: str, model: Any, opt: Any) -> float:
    import torch

    import breakpod

    every = {"tier 1 @1": 1, "tier 1 @10": 10, "skip @1": 1}.get(name)
    rules = SKIP if name == "skip @1" else None
    monitor = breakpod.watch(model, rules, optimizer=opt, check_every=every) if every else None
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    best = float("inf")
    for _ in range(STEPS):
        started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if name == "naive":
            naive_read(model)
        opt.step()
        best = min(best, time.perf_counter() - started)
    if monitor is not None:
        monitor.close()
    return best


def naive_read(model: Any) -> None:
    """The total gradient norm as clip_grad_norm_ takes it under FSDP2, read once."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    if not bool(torch.isfinite(total)):
        raise RuntimeError("the bench's model went non-finite")


def report(times: dict[str, list[float]], rounds: int, params: int) -> None:
    import torch

    print(
        f"torch {torch.__version__}, FSDP2, 2 ranks (gloo, CPU, 1 thread each), an MLP of "
        f"{LAYERS} x {WIDTH}-wide layers ({params} parameters, each layer a unit), batch "
        f"{BATCH}; ratio = median over {rounds} interleaved rounds of step time / the "
        "unmonitored step time in the same round"
    )
    print(f"{'setup':<48} {'ratio':>7}")
    base = times["none"]
    labels = {
        "none": "none (fused Adam)",
        "naive": "naive: get_total_norm + full_tensor, one read",
        "tier 1 @1": "breakpod tier 1, check_every=1 (one all-reduce)",
        "tier 1 @10": "breakpod tier 1, check_every=10",
        "skip @1": "tier 1 @1 + a skip rule (agreed by the ranks)",
    }
    for name in SETUPS:
        ratio = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        print(f"{labels[name]:<48} {ratio:>6.3f}x")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
