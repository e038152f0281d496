"""Debug mode with no breakpod line (the autostart .pth): what it installs, how it counts
steps, what each switch turns off, and that it costs nothing when off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.jobs import ROOT, script


def probe(spawn: Any, debug: bool = True, **env: str) -> tuple[str, str]:
    # the detailed tier: the NaN is the poisoned module's NAN_AT-th training forward, which
    # the sentinel's replay (one more forward) does not reproduce (tests/agent/
    # test_monitor_sentinel.py covers that path)
    full = {"PYTHONPATH": ROOT, "BREAKPOD_MONITOR_TIER": "detailed"}
    full.update({"ENABLE_REMOTE_DEBUG": "1"} if debug else {})
    full.update(env)
    child = spawn(script("probe"), env=full, stdin="closed")
    assert child.wait(timeout=90) == 0, child.stderr
    return child.stdout(), child.stderr


@pytest.mark.timeout(100)
def test_debug_mode_off_installs_nothing_and_loads_nothing(spawn: Any) -> None:
    out, err = probe(spawn, debug=False, NAN_AT="4")
    assert "before pre=0 post=0 forward=0 unloaded" in out
    assert "after pre=0 post=0 forward=0 steps=None watched=[]" in out
    assert "breakpod" not in err


@pytest.mark.timeout(100)
def test_the_models_are_found_at_the_first_step_and_count_one_step_per_iteration(
    spawn: Any,
) -> None:
    """Two optimizers (a GAN's pair) and three forwards per step (gradient accumulation):
    eight iterations are eight steps; the global forward hook is gone after the first."""
    out, err = probe(spawn, OPTIMIZERS="2", ACCUMULATE="3")
    assert "before pre=1 post=2 forward=1 loaded" in out  # post: finding, boundaries
    assert "after pre=1 post=2 forward=0 steps=8 watched=['Net', 'Linear']" in out
    assert err.count("debug mode: watching Net for anomalies") == 1, err


@pytest.mark.timeout(100)
def test_a_loop_that_calls_breakpod_step_marks_the_steps_itself(spawn: Any) -> None:
    """Its boundaries win: the optimizer's stand aside, and no monitor of debug mode's
    ends steps of its own (a job's step numbers stay the loop's)."""
    out, err = probe(spawn, EXPLICIT_STEP="1")
    assert "steps=8 watched=[]" in out, out + err
    said = [line for line in err.splitlines() if "marks its own steps" in line]
    assert len(said) == 1 and "breakpod.watch(model, optimizer=...)" in said[0], err


@pytest.mark.timeout(100)
def test_a_step_a_grad_scaler_skips_is_no_step(spawn: Any) -> None:
    """Step 3's gradients are NaN: the scaler never calls optimizer.step(), so seven of
    the eight iterations are steps (the model unwatched, so nothing parks)."""
    out, err = probe(spawn, SCALER="1", NAN_AT="3", BREAKPOD_AUTO_WATCH="0")
    assert "steps=7 watched=[]" in out, out + err
    assert "finished rank 0 finite=True" in out


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    ("switches", "installed"),
    [
        ({"BREAKPOD_AUTO_WATCH": "0"}, "after pre=0 post=2 forward=0 steps=8 watched=[]"),
        ({"BREAKPOD_AUTO_STEPS": "0"}, "before pre=1 post=1 forward=1"),
        (
            {"BREAKPOD_AUTO_WATCH": "0", "BREAKPOD_AUTO_STEPS": "0"},
            "after pre=0 post=0 forward=0 steps=None watched=[]",
        ),
    ],
    ids=["no-watch", "no-steps", "neither"],
)
def test_each_capability_switches_off_on_its_own(
    spawn: Any, switches: dict[str, str], installed: str
) -> None:
    out, err = probe(spawn, NAN_AT="4", BREAKPOD_HOLD_SECONDS="0.2", **switches)
    assert installed in out, out
    watching = switches.get("BREAKPOD_AUTO_WATCH") != "0"
    assert ("anomaly: step 4 forward block" in err) == watching, err


@pytest.mark.timeout(100)
def test_a_hang_is_a_stall_and_a_long_evaluation_is_not(spawn: Any) -> None:
    """The model's forwards (an evaluation under no_grad, with no optimizer step) keep the
    stall clock from running; a loop that does nothing for as long is a stall."""
    _, err = probe(spawn, BREAKPOD_STALL_AFTER="2", HANG_SECONDS="4")
    assert re.search(r"stall: no heartbeat for \ds \(last step 3\)", err), err
    _, err = probe(spawn, BREAKPOD_STALL_AFTER="2", EVAL_SECONDS="4")
    assert "stall" not in err, err


@pytest.mark.timeout(100)
def test_a_rules_file_replaces_the_default_park(spawn: Any, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {name: nonfinite, check: nonfinite, action: [log, skip]}\n")
    out, err = probe(spawn, NAN_AT="4", BREAKPOD_RULES=str(rules))
    assert "anomaly: step 4 forward block: [nonfinite]" in err
    assert "step 4: update skipped" in err and "waiting up to" not in err, err
    assert "finished rank 0 finite=True" in out


@pytest.mark.timeout(100)
def test_an_unreadable_rules_file_is_one_line_and_training_goes_on(
    spawn: Any, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.yaml"
    env = {"BREAKPOD_HOLD_SECONDS": "0.2", "BREAKPOD_ON_EXPIRE": "skip"}
    out, err = probe(spawn, NAN_AT="4", BREAKPOD_RULES=str(missing), **env)
    said = [line for line in err.splitlines() if "BREAKPOD_RULES" in line]
    assert len(said) == 1 and "cannot read it" in said[0], err
    assert "anomaly: step 4 forward block: [nonfinite]" in err  # the defaults still watch
    assert "finished rank 0 finite=True" in out


COMPILED = """
import sys
import torch

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
model = torch.compile(net, backend="eager", fullgraph=sys.argv[1] == "fullgraph")
for step in range(8):  # the last batch smaller: a recompile, with the monitor's hooks on
    loss = model(torch.randn(8 if step < 7 else 5, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", float(loss) == float(loss))
from breakpod._integrations import autowatch  # noqa: E402

print("captured", [m.capture.last.step for m in autowatch.monitors()])
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("graph", ["graph breaks allowed", "fullgraph"])
def test_a_compiled_job_trains_in_debug_mode(spawn: Any, graph: str) -> None:
    """Debug mode's global forward hook notes every module that runs before the first
    step; dynamo traced it inside the compiled graph, and its write into a module dict
    failed every compiled job's first call (``AssertionError: ... is already tracked for
    mutation``), fullgraph or not. It stands aside in a trace now: the compiled module's
    wrapper, which runs eagerly, is found, and the model inside it watched. The recompile
    for the last, smaller batch traces the hooks watch() added: under fullgraph=True the
    replay capture's, which broke the graph, failed it. They leave the graph now
    (root_hooks.py), and the last step is captured for replay, fullgraph or not."""
    env = {"PYTHONPATH": ROOT, "ENABLE_REMOTE_DEBUG": "1"}
    child = spawn(COMPILED, env=env, args=[graph], stdin="closed")
    assert child.wait(timeout=180) == 0, child.stderr
    out = child.stdout()
    assert "trained True" in out, child.stderr
    assert "debug mode: watching Sequential for anomalies" in child.stderr, child.stderr
    assert "captured [7]" in out, out + child.stderr


LIGHTNING_COMPILED = """
import torch
import pytorch_lightning as pl

torch.manual_seed(0)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def on_train_batch_start(self, batch, index):
        if index in (6, 7):  # one step's fault: written, then mended
            self.net[0].weight.data[0, 0] = float("nan") if index == 6 else 0.1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


module = Module()
trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(torch.compile(module, backend="eager", fullgraph=True),
            torch.utils.data.DataLoader(Data(), batch_size=4))
print("finite", bool(torch.isfinite(module.net[2].weight).all()))
"""


@pytest.mark.timeout(200)
def test_a_lightning_module_compiled_is_found_and_parks_on_a_nan(spawn: Any) -> None:
    """Lightning compiles ``training_step`` itself (``from_compiled``), so every module ran
    inside a compiled graph, where the global hook that finds the model stands aside: debug
    mode watched nothing, and said nothing. The hook marks that it was traced, and the
    model is found by the optimizer's parameters instead; its step is not replayable (it
    says so), and the NaN parks before the update, which the expired hold skips. Its
    stall clock's forward hook, traced in the graph now, stands aside there (its clock
    read failed the fullgraph compile)."""
    env = {"PYTHONPATH": ROOT, "ENABLE_REMOTE_DEBUG": "1", "BREAKPOD_HOLD_SECONDS": "0.5"}
    env["BREAKPOD_ON_EXPIRE"] = "skip"
    child = spawn(LIGHTNING_COMPILED, env=env, stdin="closed")
    assert child.wait(timeout=180) == 0, child.stderr
    err = child.stderr
    assert "debug mode: watching Module for anomalies" in err, err
    assert "not seen in a training step" in err, err
    assert "anomaly: step 6 loss <model>: [nonfinite] loss is nan: waiting up to" in err, err
    assert "step 6: update skipped" in err, err
    assert "finite True" in child.stdout(), err


UNHASHABLE_OPTIMIZER = """
import torch


class Sgd(torch.optim.SGD):
    def __eq__(self, other):  # __eq__ without __hash__: its instances cannot be hashed
        return self is other


model = torch.nn.Linear(2, 1)
opt = Sgd(model.parameters(), lr=0.1)
for step in range(4):
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
print("trained", step)
"""


@pytest.mark.timeout(100)
def test_an_optimizer_that_cannot_be_hashed_trains_on_in_debug_mode(spawn: Any) -> None:
    """Debug mode's step post-hook looked the optimizer up in a set before its guard:
    ``TypeError: unhashable type`` came out of the job's own ``opt.step()``."""
    child = spawn(UNHASHABLE_OPTIMIZER, env={"ENABLE_REMOTE_DEBUG": "1"}, stdin="closed")
    assert child.wait(timeout=90) == 0, child.stderr
    assert "trained 3" in child.stdout(), child.stderr
    assert "unhashable" in child.stderr  # said once, as every failure inside debug mode
