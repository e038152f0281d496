"""A NaN born in one module, under each framework, with no breakpod line (debug mode
alone) and with an explicit watch(): the module is named, and the job parks before the
update (the hold expires and BREAKPOD_ON_EXPIRE=skip drops it), so the weights stay finite."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.frameworks.jobs import ROOT, script

FRAMEWORKS = {  # script -> the module the NaN is born in, as the report names it
    "plain": "block",
    "hf_trainer": "transformer.h.1.mlp",
    "accelerate_loop": "block",
    "lightning_fit": "block",  # zero code: the outermost module that ran (net)
}
EXPLICIT_NAME = {"lightning_fit": "net.block"}  # watch(self) names it from the LightningModule
EXPIRE = {"BREAKPOD_HOLD_SECONDS": "0.5", "BREAKPOD_ON_EXPIRE": "skip", "NAN_AT": "4"}


def run(spawn: Any, name: str, mode: str, **env: str) -> Any:
    debug = {"ENABLE_REMOTE_DEBUG": "1"} if mode == "zero" else {"MODE": "explicit"}
    # the detailed tier: the NaN is the poisoned module's NAN_AT-th training forward, which
    # the sentinel's replay (one more forward) does not reproduce
    tier = {"BREAKPOD_MONITOR_TIER": "detailed"}
    full = {"PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", **tier, **debug, **EXPIRE, **env}
    return spawn(script(name), env=full, stdin="closed")


# zero code under HF and a plain loop: the attached tests below; explicit watch() in a
# plain loop and with accelerate: tests/agent/test_anomaly_before_update.py and
# test_wrapped_optimizers.py, in-process
CASES = [
    ("explicit", "hf_trainer"),  # watch(optimizer=...) from TrainerCallback.on_train_begin
    ("explicit", "lightning_fit"),
    ("zero", "accelerate_loop"),
    ("zero", "lightning_fit"),
]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "name"), CASES)
def test_a_nan_names_its_module_and_parks_before_the_update(
    spawn: Any, name: str, mode: str
) -> None:
    child = run(spawn, name, mode)
    assert child.wait(timeout=140) == 0, child.stderr
    module = EXPLICIT_NAME.get(name, FRAMEWORKS[name]) if mode == "explicit" else FRAMEWORKS[name]
    err = child.stderr
    parked = re.search(rf"anomaly: step 4 forward {re.escape(module)}: .*waiting up to", err)
    assert parked, err
    assert "step 4: update skipped (gradients dropped before the optimizer step)" in err, err
    assert "finished rank 0 finite=True" in child.stdout(), err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_attached_client_sees_finite_weights_and_reaches_the_trainer(
    spawn: Any, pdb_client: Any
) -> None:
    """HF Trainer, no code: parked in accelerate's step, `up` reaches the Trainer's loop,
    where the model is; the weights are the previous step's; `skip` drops the update."""
    child = run(spawn, "hf_trainer", "zero", BREAKPOD_HOLD_SECONDS="120")
    client = pdb_client(child.park_port(timeout=120))
    banner = client.read_until()
    assert "anomaly: step 4 forward transformer.h.1.mlp" in banner, banner
    for _ in range(12):  # out through accelerate to the Trainer's frame
        if client.command("p 'model' in dir() and 'optimizer' in dir()").strip() == "True":
            break
        client.command("up")
    assert client.command("p type(model).__name__").strip() == "'GPT2LMHeadModel'"
    finite = "all(bool(p.isfinite().all()) for p in model.parameters())"
    assert client.command(f"p {finite}").strip() == "True"
    assert "trainer.py" in client.command("where")
    client.send("skip")
    assert "update will be skipped" in client.read_all()
    assert child.wait(timeout=120) == 0, child.stderr
    assert "finished rank 0 finite=True" in child.stdout()


@pytest.mark.timeout(120)
def test_a_plain_loop_parks_in_the_users_frame_and_c_resumes(spawn: Any, pdb_client: Any) -> None:
    child = run(spawn, "plain", "zero", BREAKPOD_HOLD_SECONDS="120")
    client = pdb_client(child.park_port(timeout=60))
    banner = client.read_until()
    assert re.search(r"child\d+\.py\(\d+\)<module>\(\)\n-> opt\.step\(\)", banner), banner
    assert client.command("p type(model).__name__, type(opt).__name__").strip() == "('Net', 'SGD')"
    assert client.command("p bool(model.block.weight.isfinite().all())").strip() == "True"
    assert client.command("p anomaly.module").strip() == "'block'"
    flight = client.command("flight")  # the flight recorder, with no breakpod.step()
    first = flight.split("first bad step per module")[1].splitlines()[1].split()
    assert first[:4] == ["block", "forward", "step", "4"], flight
    client.send("c")
    client.read_all()
    assert child.wait(timeout=60) == 0, child.stderr
    assert "finished rank 0 finite=False" in child.stdout()  # continued: the NaN was applied
