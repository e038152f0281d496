"""Lifecycle and containment: models are freed, memory stays bounded, failures stay inside."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import breakpod
from breakpod.monitor import monitor_of
from tests.agent.nets import Net, train


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


def test_the_monitor_lives_as_long_as_its_model():
    model = Net()
    breakpod.watch(model)  # the caller keeps no reference to the monitor
    gc.collect()
    monitor = monitor_of(model)
    assert monitor is not None and monitor.enabled
    monitor.close()
    assert monitor_of(model) is None
