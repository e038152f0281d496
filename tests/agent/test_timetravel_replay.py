"""``replay`` and ``whatif`` at a real anomaly park: a child job, stdin closed, over the socket."""

from __future__ import annotations

import os
import re
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# A submodule computes sqrt(h - shift); the shift makes the argument negative at step 4.
# A custom autograd.Function turns its gradient non-finite in backward at step 4.
JOB = """
    import torch
    from torch import nn
    import breakpod

    class DivByZeroGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad / (grad * 0)  # BACKWARD LINE

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = 0.0
            self.bad_grad = False

        def forward(self, h):
            if self.bad_grad:
                h = DivByZeroGrad.apply(h)
            return torch.sqrt(h - self.shift)  # SQRT LINE

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.act = nn.ReLU()
            self.shifted = Shifted()
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(self.shifted(self.act(self.fc1(x)) + 1.0))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rules = [{"name": "nan-break", "check": "nonfinite", "action": ["log", "break"]}]
    monitor = breakpod.watch(model, rules, optimizer=opt)
    for step in range(7):
        MODE
        x = torch.randn(32, 8)
        y = torch.randint(0, 4, (32,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step(loss)
    print("finished", monitor.step_count)
"""

SQRT = "model.shifted.shift = 100.0 if step == 4 else 0.0"
BAD_GRAD = "model.shifted.bad_grad = step == 4; model.shifted.shift = 0.0"
SNAPSHOT = (
    "!snap = [t.detach().clone() for t in [*model.parameters(), "
    "*(p.grad for p in model.parameters()), *(s['momentum_buffer'] for s in opt.state.values())]]"
)
SAME = (
    "p all(torch.equal(a.view(torch.int32), b.detach().view(torch.int32)) for a, b in zip(snap, "
    "[*model.parameters(), *(p.grad for p in model.parameters()), "
    "*(s['momentum_buffer'] for s in opt.state.values())], strict=True))"
)


def line_of(marker: str) -> int:
    lines = textwrap.dedent(JOB).splitlines()  # as spawn writes it
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def start(spawn, pdb_client, mode: str, tier: str = "sentinel"):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_MONITOR_TIER": tier}
    child = spawn(JOB.replace("MODE", mode), env=env, stdin="closed")
    client = pdb_client(child.park_port(timeout=90))
    banner = client.read_until()
    assert "anomaly: step 4" in banner and "[nan-break]" in banner, banner
    return child, client


def finish(child, client) -> None:
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished 7" in child.stdout(), child.stderr


@pytest.mark.timeout(180)
def test_replay_names_the_sqrt_and_its_line_and_the_job_goes_on(spawn, pdb_client):
    child, client = start(spawn, pdb_client, SQRT)
    client.command(SNAPSHOT)
    out = client.command("replay")
    assert "replay of step 4" in out and "reproduced bit-exactly" in out, out
    found = re.search(r"first non-finite op: (\S+) \((\w+)\) in module '(\S+)' at (\S+)", out)
    assert found, out
    assert found.groups() == (
        "aten.sqrt.default",
        "forward",
        "shifted",
        f"child0.py:{line_of('SQRT LINE')}",
    ), out
    assert "input 0: tensor[32,16]" in out and "nan=" in out.split("output:")[1], out
    assert client.command(SAME).strip() == "True"  # grads and weights as they were
    finish(child, client)


@pytest.mark.timeout(180)
def test_replay_names_the_op_of_a_custom_backward_and_whatif_leaves_the_model(spawn, pdb_client):
    child, client = start(spawn, pdb_client, BAD_GRAD)
    assert "backward" in client.command("p anomaly.phase")
    client.command(SNAPSHOT)
    out = client.command("replay")
    found = re.search(r"first non-finite op: (\S+) \((\w+), autograd node (\w+)\).* at (\S+)", out)
    assert found, out
    assert found.groups() == (
        "aten.div.Tensor",
        "backward",
        "DivByZeroGradBackward",
        f"child0.py:{line_of('BACKWARD LINE')}",
    ), out
    assert "reproduced bit-exactly" in out, out

    out = client.command("whatif lr=0")
    assert "the real model is untouched" in out, out
    loss = re.search(r"step 4 \(lr=0\): loss (\S+), grad norm", out)
    assert loss and 0 < float(loss.group(1)) < 10, out  # finite: the forward was healthy
    assert "step 5 (same batch)" in out, out
    assert client.command(SAME).strip() == "True"

    out = client.command("whatif clip=1.0 loss=torch.nn.functional.cross_entropy(out, y)")
    step5 = re.search(r"step 5 \(same batch\): loss (\S+)", out)
    assert step5 and step5.group(1) != "n/a", out
    assert "unknown change" in client.command("whatif momentum=3")
    assert client.command(SAME).strip() == "True"
    finish(child, client)


@pytest.mark.timeout(180)
def test_flight_at_the_park_names_the_module_and_step_and_shows_its_steps(spawn, pdb_client):
    child, client = start(spawn, pdb_client, SQRT, tier="detailed")  # per-module rows
    out = client.command("flight")
    assert "flight recorder: steps 0-4 (5 kept)" in out, out
    first = out.split("first bad step per module")[1].splitlines()[1].split()
    assert first[:4] == ["shifted", "forward", "step", "4"], out
    assert first[4] == "nan", out
    out = client.command("flight shifted")
    assert "shifted backward:" in out, out  # its input gradient too
    forward = out.split("shifted forward: step, rms, max|x|")[1].split("shifted backward")[0]
    rows = [line.split() for line in forward.splitlines() if line.strip()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"], out
    assert rows[-1][1:] == ["nan", "nan", "nan"] and "nan" not in rows[0], out
    assert "no watched module 'nope'" in client.command("flight nope")
    finish(child, client)


UNUSED_OUTPUT_UNDER_DDP = """
import sys
import torch
import torch.distributed as dist
import breakpod

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h = self.trunk(x)
        return self.a(h), self.b(h)


torch.manual_seed(0)
model = TwoHeads()
ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
monitor = breakpod.watch(model, optimizer=opt)  # the module DDP holds, as debug mode sees it
for step in range(6):
    x = torch.randn(8, 4)
    if step == 4:
        x[0, 0] = float("nan")
    a, _unused = ddp(x)
    opt.zero_grad()
    a.pow(2).mean().backward()
    opt.step()
monitor.close()
for found in monitor.anomalies:
    print("found", found, "| how", found.how)
print("errors", monitor.errors)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_an_output_no_loss_uses_under_ddp_never_breaks_the_backward(spawn, tmp_path):
    """DDP hands the hook on an output that no loss used a None gradient: the capture's
    hook read it (``'NoneType' object has no attribute 'detach'``) inside autograd, and
    the training job died in its first backward. The step still replays."""
    child = spawn(UNUSED_OUTPUT_UNDER_DDP, args=[str(tmp_path / "store")])
    assert child.wait(timeout=100) == 0, child.stderr
    out = child.stdout()
    assert "errors 0" in out, (out, child.stderr)
    found = re.search(r"^found step 4 input trunk: \[nonfinite\] .* \| how replay$", out, re.M)
    assert found, (out, child.stderr)
