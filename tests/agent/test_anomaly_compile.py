"""torch.compile never crashes training; a NaN is found at the right module or we say why.

The sentinel tier (the default) hooks no module, so a compiled model loses nothing: its
step is captured at the root and replayed eagerly, which names the same first bad module
and phase as an eager model. The detailed tier's hooks do not run inside the graph, and
it says so."""

from __future__ import annotations

import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

SETUP = """
    import os, sys
    import torch
    from torch import nn
    import breakpod

    backend, setup = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if setup == "watch-then-compile":
        monitor = breakpod.watch(model)
        run = torch.compile(model, backend=backend)
    elif setup == "a-twin-alongside":  # an unwatched copy, compiled too (a reference model)
        twin = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                             backend=backend)
        monitor = breakpod.watch(model)
        run = torch.compile(model, backend=backend)
    elif setup == "watch-compiled":
        run = torch.compile(model, backend=backend)
        monitor = breakpod.watch(run)
    else:  # disable-after-first-call: the switch set after a compiled call
        run = torch.compile(model, backend=backend)
        run(torch.randn(2, 4)).sum().backward()
        os.environ["BREAKPOD_DISABLE_COMPILE"] = "1"
        monitor = breakpod.watch(model)
    for step in range(4):
        x = torch.randn(2, 4)
        if setup == "a-twin-alongside":
            twin(x).sum().backward()
        if step == 3:
            model[0].weight.data[0, 0] = float("nan")  # corrupt the first layer
        run(x).sum().backward()
        monitor.step()
    print("anomalies", [(a.step, a.module, a.phase, a.how) for a in monitor.anomalies],
          monitor.errors)
"""


SETUPS = ["watch-then-compile", "watch-compiled", "disable-after-first-call"]
CASES = [(b, s) for b in ("eager", "aot_eager") for s in SETUPS]
CASES.append(("inductor", "watch-then-compile"))  # a C++ compile: one case only
# dynamo reuses the twin's graph, traced without hooks, for the watched model (it guards
# neither on the module nor on its hooks): no hook ran in it, so no step was captured. The
# hooks run on the compiled wrapper now, whichever graph runs inside
CASES += [("eager", "a-twin-alongside"), ("inductor", "a-twin-alongside")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("backend", "setup"), CASES)
def test_compiled_setups_never_crash_and_replay_names_the_first_bad_module(spawn, backend, setup):
    child = spawn(textwrap.dedent(SETUP), env={"PYTHONPATH": ROOT}, args=[backend, setup])
    assert child.wait(timeout=200) == 0, child.stderr
    out = child.stdout()
    assert "anomalies [(3, '0', 'forward', 'replay')] 0" in out, out + child.stderr
    assert "ran under torch.compile" not in child.stderr, child.stderr


DETAILED = [("eager", "watch-then-compile"), ("aot_eager", "watch-compiled")]
DETAILED.append(("eager", "disable-after-first-call"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("backend", "setup"), DETAILED)
def test_the_detailed_tier_under_compile_blames_the_parameters_and_says_why(spawn, backend, setup):
    env = {"PYTHONPATH": ROOT, "BREAKPOD_MONITOR_TIER": "detailed"}
    child = spawn(textwrap.dedent(SETUP), env=env, args=[backend, setup])
    assert child.wait(timeout=200) == 0, child.stderr
    out = child.stdout()
    compiled = setup != "disable-after-first-call"
    phase = "backward" if compiled else "forward"  # a parameter's gradient, or its output
    assert f"anomalies [(3, '0', '{phase}', 'live')] 0" in out, out + child.stderr
    assert ("ran under torch.compile" in child.stderr) == compiled, child.stderr


LOSS_SKIP = """
    import sys
    import torch
    from torch import nn
    import breakpod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    run = torch.compile(model, backend=sys.argv[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"name": "lspike", "check": "loss_spike", "action": ["log", "skip"]}]
    monitor = breakpod.watch(run, rules, optimizer=opt)
    for step in range(16):
        loss = run(torch.randn(16, 4)).pow(2).mean() * (1000 if step == 13 else 1)
        opt.zero_grad()
        loss.backward()
        monitor.record_loss(loss)  # before the update: judged with its own step
        before = model[0].weight.clone()
        opt.step()
        if step == 13:
            print("updated at the spike", bool((model[0].weight != before).any()))
    print("found", [(a.step, a.check, a.skipped) for a in monitor.anomalies if a.phase == "loss"])
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_models_loss_is_judged_with_its_own_step_before_the_update(spawn, backend):
    """The end of a compiled model's backward went unheard (its output hook did not run in
    the graph), so with ``optimizer=`` every loss was taken for the previous step's, read
    after its update: a loss spike at step 13 was said at step 12, and its skip came too
    late ("update not skipped: it was applied before the anomaly was found")."""
    child = spawn(textwrap.dedent(LOSS_SKIP), env={"PYTHONPATH": ROOT}, args=[backend])
    assert child.wait(timeout=200) == 0, child.stderr
    out = child.stdout()
    assert "found [(13, 'loss_spike', True)]" in out, out + child.stderr
    assert "updated at the spike False" in out, out + child.stderr
    assert "applied before the anomaly was found" not in child.stderr, child.stderr


FULLGRAPH = """
    import sys
    import torch
    from torch import nn
    import breakpod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backend, order, tier = sys.argv[1:4]
    rules = [{"name": "lspike", "check": "loss_spike", "action": ["log", "skip"]}]
    if order == "compiled-first":
        run = torch.compile(model, backend=backend, fullgraph=True)
        monitor = breakpod.watch(run, rules, optimizer=opt, tier=tier)
    else:  # the hooks are there when dynamo traces: none of them may break the graph
        monitor = breakpod.watch(model, rules, optimizer=opt, tier=tier)
        run = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(16):
        x = torch.randn(8 if step < 15 else 5, 4)  # the last batch smaller: a recompile
        if step == 14:
            model[0].weight.data[0, 0] = float("nan")  # corrupt the first layer
        loss = run(x).pow(2).mean() * (1000 if step == 11 else 1)
        opt.zero_grad()
        loss.backward()
        monitor.record_loss(loss)  # before the update: judged with its own step
        before = model[2].weight.clone()
        opt.step()
        if step == 11:
            print("updated at the spike", bool((model[2].weight != before).any()))
        if step == 14:
            model[0].weight.data[0, 0] = 0.5  # the job goes on
    print("found", sorted({(a.step, a.check, a.module, a.how) for a in monitor.anomalies}))
    print("trained", monitor.step_count, monitor.errors)
"""

FULLGRAPH_CASES = [
    ("eager", "watch-first", "sentinel"),
    ("aot_eager", "watch-first", "sentinel"),
    ("eager", "compiled-first", "sentinel"),
    ("inductor", "watch-first", "sentinel"),
    ("eager", "watch-first", "detailed"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "order", "tier"), FULLGRAPH_CASES)
def test_fullgraph_compile_is_captured_replayed_and_judged_in_time(spawn, backend, order, tier):
    """``fullgraph=True`` forbids a graph break. The root hooks (the capture's, the step
    marks') used to run eagerly inside the graph, a break: dynamo failed the first
    compiled call (``Attempted to call function marked as skipped``), so the capture had
    to be off, a NaN went unlocalized and a loss was judged a step late, after the update.
    Now they leave the graph at the first step's end (root_hooks.py): the step of a NaN is
    replayed to its first bad module, and a loss spike is skipped in its own step."""
    args = [backend, order, tier]
    child = spawn(textwrap.dedent(FULLGRAPH), env={"PYTHONPATH": ROOT}, args=args)
    assert child.wait(timeout=260) == 0, child.stderr
    out = child.stdout()
    assert "trained 16 0" in out, out + child.stderr
    assert "updated at the spike False" in out, out + child.stderr
    assert "(11, 'loss_spike', '', " in out, out + child.stderr
    # the detailed tier's module hooks stand aside in the graph, and it says so
    nan = "(14, 'nonfinite', '0', 'replay')" if tier == "sentinel" else "(14, 'nonfinite', "
    assert nan in out, out + child.stderr
    assert ("ran under torch.compile" in child.stderr) == (tier == "detailed"), child.stderr
    assert "not seen in a training step" not in child.stderr, child.stderr
