"""The monitors on pytorch/examples' own models (mnist, word_language_model), random data,
tiny sizes, their training loops as the examples write them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import breakpod
from tests.agent.pytorch_examples import mnist
from tests.agent.pytorch_examples import word_language_model as wlm

NTOKEN = 50


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_mnist_a_nan_batch_in_the_documented_order_is_named_and_skipped():
    """watch(optimizer=), monitor.step(loss) before optimizer.step(), as docs/monitors.md has it."""
    model = mnist.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    rules = [{"check": "nonfinite", "action": ["log", "skip"]}]
    monitor = breakpod.watch(model, rules, optimizer=optimizer)
    for step in range(5):
        data, target = mnist.batch(step)
        if step == 3:
            data[0, 0, 5, 5] = float("nan")
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        monitor.step(loss)
        optimizer.step()
    monitor.close()
    (a,) = monitor.anomalies
    assert (a.step, a.phase, a.module, a.skipped) == (3, "input", "conv1", True), a
    assert _finite(model)


def test_mnist_a_nan_weight_is_named_at_its_module_and_step():
    model = mnist.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], optimizer=optimizer)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                model.fc1.weight[0, 0] = float("nan")
        data, target = mnist.batch(step)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        monitor.step(loss)
        optimizer.step()
    monitor.close()
    first = monitor.anomalies[0]
    assert (first.step, first.phase, first.module) == (2, "forward", "fc1"), first
    assert first.details["nonfinite_params"] == ["fc1.weight"], first


def _transformer() -> wlm.TransformerModel:
    return wlm.TransformerModel(NTOKEN, 16, 2, 32, 2, dropout=0.2)


def _train_lm(model: nn.Module, steps: int, before=None, lr: float = 20.0, rnn: bool = False):
    """main.py's train(): manual SGD after clip_grad_norm_, the monitor's step before it;
    returns the monitor and the replay of the first step that reported."""
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], replay=True)
    hidden = model.init_hidden(4) if rnn else None
    report = None
    for step in range(steps):
        if before is not None:
            before(step)
        data, targets = wlm.batch(step, NTOKEN)
        model.zero_grad()
        if rnn:
            hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(data, hidden)
        else:
            output = model(data).view(-1, NTOKEN)
        loss = F.nll_loss(output, targets)
        loss.backward()
        monitor.step(loss)
        if monitor.anomalies and report is None:
            report = monitor.replay()
            break
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    else:
        report = monitor.replay()
    monitor.close()
    return monitor, report


def test_word_language_model_transformer_a_nan_weight_is_never_blamed_on_the_mask():
    model = _transformer()

    def poison(step: int) -> None:
        if step == 2:
            with torch.no_grad():
                model.encoder.layers[1].linear1.weight[0, 0] = float("nan")

    monitor, report = _train_lm(model, 4, poison)
    first = monitor.anomalies[0]
    assert (first.step, first.module) == (2, "encoder.layers.1.linear1"), first
    text = "\n".join(report.lines())
    assert "aten.full" not in text and "aten.log" not in text, text
    assert report.first is None and report.first_any is not None, text
    assert report.first_any.module == "encoder.layers.1.linear1", text


def test_word_language_model_transformer_clean_replays_with_nothing_found():
    monitor, report = _train_lm(_transformer(), 3)
    assert not monitor.anomalies
    assert report.first is None and report.first_any is None, report.lines()


def test_word_language_model_lstm_never_lists_finite_parameters_as_nonfinite():
    """lr=1e38: the weights grow past what their float32 L2 norm can hold before any is
    NaN/Inf; nonfinite_params must name only parameters that hold such values."""
    model = wlm.RNNModel("LSTM", NTOKEN, 16, 16, 2, dropout=0.2)
    checked = []

    def check(step: int) -> None:
        for a in monitor.anomalies[len(checked) :]:
            listed = set(a.details.get("nonfinite_params", []))
            bad = {n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())}
            assert listed <= bad, (a, bad)
            checked.append(a)

    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}])
    hidden = model.init_hidden(4)
    for step in range(6):
        data, targets = wlm.batch(step, NTOKEN)
        model.zero_grad()
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = model(data, hidden)
        loss = F.nll_loss(output, targets)
        loss.backward()
        monitor.step(loss)
        check(step)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-1e38)
    monitor.close()
    assert monitor.anomalies
