"""``replay`` never blames an attention mask's intended -inf, and still names the real bug
after it: nn.TransformerEncoder with a causal mask, scaled_dot_product_attention(is_causal=True),
an HF GPT-2 model (random init); a clean masked transformer replays with nothing found."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import breakpod
from breakpod._monitor.timetravel.replay import ReplayReport

VOCAB, D, T = 40, 16, 10


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)
    torch.manual_seed(0)


class Bug(nn.Module):
    """After the attention: sqrt of negatives (NaN from finite values) when switched on."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h - 100.0) if self.on else h


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.bug = Bug()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # -inf above
        return self.head(self.bug(self.encoder(self.emb(tokens), mask=mask, is_causal=True)))


class CausalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, D))


class SdpaLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.attn = CausalAttention()
        self.bug = Bug()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bug(self.attn(self.emb(tokens))))


class Gpt2LM(nn.Module):
    def __init__(self, attention: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=2
        )
        config._attn_implementation = attention
        self.gpt2 = transformers.GPT2Model(config)
        self.bug = Bug()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(tokens)
        mask[0, :3] = 0  # left padding: a masked row, as a batch of prompts has
        hidden = self.gpt2(input_ids=tokens, attention_mask=mask).last_hidden_state
        return self.head(self.bug(hidden))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "transformer-encoder-causal-mask": EncoderLM,
    "sdpa-is-causal": SdpaLM,
    "hf-gpt2-eager": lambda: Gpt2LM("eager"),
    "hf-gpt2-sdpa": lambda: Gpt2LM("sdpa"),
}


def replay_at(model: nn.Module, bad_step: int | None, steps: int = 3) -> ReplayReport:
    """Train until the monitor reports (or ``steps``), then replay, before the update;
    ``model.bug.on`` (or ``model.on``) is the fault, switched on at ``bad_step``."""
    switch = getattr(model, "bug", model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], replay=True)
    try:
        for step in range(steps):
            if bad_step is not None:
                switch.on = step == bad_step
            tokens = torch.randint(0, VOCAB, (3, T + 1))
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            monitor.step(loss)  # before the update: the verdict first
            if monitor.anomalies or step == steps - 1:
                assert [a.step for a in monitor.anomalies] == ([step] if bad_step else [])
                return monitor.replay()
            opt.step()
        raise AssertionError("unreachable")
    finally:
        monitor.close()


@pytest.mark.parametrize("name", MODELS)
def test_replay_names_the_bug_after_the_mask(name):
    report = replay_at(MODELS[name](), bad_step=2)
    assert report.reproduced is True, report.lines()
    assert report.first is not None and report.first.born, report.lines()
    assert (report.first.op, report.first.module) == ("aten.sqrt.default", "bug"), report.lines()


@pytest.mark.parametrize("name", MODELS)
def test_a_clean_masked_transformer_replays_with_nothing_found(name):
    report = replay_at(MODELS[name](), bad_step=None)
    assert report.first is None and report.first_any is None, report.lines()
    assert "no op produced a non-finite value" in "\n".join(report.lines())


class FullyMasked(nn.Module):
    """A padding mask that hides every key of row 0: softmax over all -inf is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB)
        self.on = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        scores = h @ h.transpose(1, 2)
        hidden = torch.zeros_like(scores, dtype=torch.bool)
        hidden[0] = self.on  # every key of the first sequence hidden
        scores = scores.masked_fill(hidden, float("-inf"))
        return self.head(scores.softmax(-1) @ h)


def test_a_mask_that_leaves_nothing_to_attend_is_blamed_where_it_turns_nan():
    model = FullyMasked()
    report = replay_at(model, bad_step=1)
    first = report.first
    assert first is not None and first.op == "aten.masked_fill.Scalar", report.lines()
    assert "became NaN at aten._softmax.default" in first.then, report.lines()


def test_an_infinity_that_reaches_the_output_is_blamed():
    """log(0) after the mask: -inf goes straight to the logits (the loss's input)."""

    class LogZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = EncoderLM()  # its own bug stays off
            self.on = False

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            logits = self.inner(tokens)
            return torch.log(logits * 0) if self.on else logits

    model = LogZero()
    report = replay_at(model, bad_step=1)
    first = report.first
    assert first is not None and first.op == "aten.log.default", report.lines()
    assert first.then == "reached the model's output", report.lines()


class GivenMask(nn.Module):
    """An additive -inf mask kept as a buffer, and one passed in with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.register_buffer("causal", torch.full((T, T), float("-inf")).triu(1))
        self.bug = Bug()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(tokens)
        scores = h @ h.transpose(1, 2) + self.causal
        if padding is not None:
            scores = scores + padding[:, None, :]
        return self.head(self.bug(scores.softmax(-1) @ h))


def test_masks_given_as_a_buffer_or_with_the_batch_are_never_blamed():
    model = GivenMask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], replay=True)
    padding = torch.zeros(3, T)
    padding[:, -2:] = float("-inf")
    for step in range(3):
        model.bug.on = step == 2
        tokens = torch.randint(0, VOCAB, (3, T + 1))
        logits = model(tokens[:, :-1], padding)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        monitor.step(loss)
        if step < 2:
            assert not monitor.anomalies
            opt.step()
    report = monitor.replay()
    monitor.close()
    assert report.first is not None and report.first.op == "aten.sqrt.default", report.lines()


class WritesInPlace(torch.nn.Module):
    """A value read finite by one op, then made NaN in place by the next: the op that
    wrote it is the one to name (a value's finiteness is read once per version of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = h * 2  # reads h, finite
        h.mul_(0).div_(0)  # 0/0 in place: NaN, born in div_
        return y + h


def test_a_value_made_nan_in_place_after_it_was_read_finite_names_the_op_that_wrote_it():
    torch.manual_seed(0)
    model = WritesInPlace()
    monitor = breakpod.watch(model, [{"check": "nonfinite", "action": "log"}], replay=True)
    model(torch.randn(3, 4)).sum().backward()
    monitor.step()
    report = monitor.replay()
    monitor.close()
    assert report.first is not None, report.lines()
    # in the root's own forward (module ""), not fc's
    assert (report.first.op, report.first.module) == ("aten.div_.Tensor", ""), report.lines()
