"""Lifecycle and containment: models are freed, memory stays bounded, failures stay inside."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import breakpod
from breakpod._monitor.monitor import monitor_of
from tests.agent.nets import Net, batch, train


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def test_a_watched_model_is_freed_after_del_without_close():
    refs = []
    for _ in range(3):
        model = Net()
        monitor = breakpod.watch(model)
        optimizer = train(model, monitor, 2)
        refs.append(weakref.ref(model))
        del model, monitor, optimizer
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_last_agreement_owed_at_the_end_of_training_frees_the_model_and_optimizer():
    """A monitor closed in a job of several ranks owes its peers one last agreement at the
    optimizer's next update (peers.py), which never comes once training is over. The
    departure held the optimizer and the model, and its optimizer's entry held it: the
    model and its optimizer state outlived every run of a sweep."""
    from breakpod._monitor.peers import Departure, Peers, departures_at

    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    peers = Peers([], [0, 1])  # two ranks' agreement, not yet made (no process group here)
    departures_at(optimizer).owed.append(Departure(peers, 3, optimizer, model))
    refs = [weakref.ref(model), weakref.ref(optimizer)]
    del model, optimizer
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_watched_model_saved_whole_loads_unwatched():
    """``torch.save(model)`` pickles the model's hooks with it: the root hooks' capture
    clock (a lambda) failed it. The loaded model's root hooks do nothing, and a deep
    copy (an EMA model) shares the original's, as it shares its module hooks."""
    import copy
    import io

    model = Net()
    monitor = breakpod.watch(model)
    train(model, monitor, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    last = monitor.capture.last
    loaded(batch(0)[0]).sum().backward()
    assert monitor.capture.last is last and monitor.errors == 0  # not the monitor's forward
    copy.deepcopy(model)(batch(1)[0])
    assert monitor.capture.last is not last  # the copy's forward is heard, as before
    monitor.close()
    again = breakpod.watch(loaded)  # the loaded model can be watched itself
    train(loaded, again, 2)
    assert again.step_count == 2 and again.errors == 0 and again.capture.last.step == 1
    again.close()


def test_the_monitor_lives_as_long_as_its_model():
    model = Net()
    breakpod.watch(model)  # the caller keeps no reference to the monitor
    gc.collect()
    monitor = monitor_of(model)
    assert monitor is not None and monitor.enabled
    monitor.close()
    assert monitor_of(model) is None


def _held(monitor) -> list[torch.Tensor]:
    """Tensors the monitor keeps for break/snapshot actions, pending or in flight."""
    steps = [
        monitor._current,
        *monitor._pending,
        *(s for _, _, ss in monitor._inflight for s in ss),
    ]
    return [t for s in steps for t in s.kept.values()]


def test_tensors_kept_for_break_rules_live_one_step_whatever_check_every():
    model = Net()
    rules = [{"name": "nan-snap", "check": "nonfinite", "action": ["snapshot"]}]
    monitor = breakpod.watch(model, rules, check_every=50, tier="detailed")
    x = torch.randn(32, 8)
    model(x).sum().backward()
    one_step = len(_held(monitor))
    assert one_step > 0 and all(t.grad_fn is None for t in _held(monitor))
    monitor.step()
    peak = 0
    for _ in range(10):
        model(x).sum().backward()
        monitor.step()
        peak = max(peak, len(_held(monitor)))
    assert peak <= one_step
    monitor.close()
    assert _held(monitor) == []


def test_the_anomaly_list_keeps_no_tensors(tmp_path):
    model = Net()
    rules = [{"name": "nan-snap", "check": "nonfinite", "action": ["snapshot"]}]
    monitor = breakpod.watch(model, rules, snapshot_dir=tmp_path)

    def before(step):
        model.poison.mode = "forward" if step == 1 else None

    train(model, monitor, 3, before=before, lr=0.0)
    assert [(a.rule, a.step) for a in monitor.anomalies] == [("nan-snap", 1)]
    assert all(a.tensor is None for a in monitor.anomalies)
    saved = torch.load(next(tmp_path.glob("*.pt")), weights_only=False)
    assert saved["tensor"].shape == (32, 16)


class Shapeless(torch.Tensor):
    """A tensor subclass whose shape cannot be read."""

    @property
    def shape(self) -> torch.Size:
        raise RuntimeError("this tensor has no shape")


class ShapelessInside(torch.nn.Module):
    """A module no rule watches gets a tensor whose shape cannot be read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.ident = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ident(torch.ones(2, 4).as_subclass(Shapeless))
        return self.fc(x)


def test_a_failure_in_the_shape_hook_is_contained_and_training_goes_on(capfd):
    model = ShapelessInside()
    monitor = breakpod.watch(model, tier="detailed")  # shape hooks
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        monitor.step()
    assert monitor.step_count == 3 and monitor.errors == 3
    assert capfd.readouterr().err.count("monitor shape hook failed") == 1  # reported once
    assert "fc" in monitor.shapes
    monitor.close()
