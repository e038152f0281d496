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
