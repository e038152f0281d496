"""Bad monitor configuration: one line naming the file, the field and the value."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import breakpod
from breakpod._core.errors import ConfigError
from breakpod._monitor.rules import glob_match


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    monkeypatch.delenv("AI_DEBUG_MODE", raising=False)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"rules:\n  - check: nonfinite\n  # \xff\xfe\n", "not UTF-8 text"),
        (b"rules: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
        (b"expect: [1, 2]\n", "field 'expect'"),
        (b"expect:\n", "field 'expect'"),
        (b"snapshot_dir: 5\n", "field 'snapshot_dir'"),
        (b"defaults: 'false'\n", "field 'defaults'"),
        (b"rules: {rules: [], defaults: 'no'}\n", "field 'defaults'"),
        (b"rules:\n  - {check: activation, max_mean_abs: 1e-3}\n", "1.0e-3"),
    ],
)
def test_each_bad_config_file_gets_one_line_naming_file_field_and_value(tmp_path, text, said):
    path = tmp_path / "monitor.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as info:
        breakpod.watch(model(), config=path)
    message = str(info.value)
    assert said in message and "\n" not in message, message
    assert "monitor.yaml" in message or "rule" in message, message


def test_defaults_false_as_a_bool_still_drops_the_builtin_rules():
    monitor = breakpod.watch(model(), config={"defaults": False, "rules": []})
    assert monitor.rules == []
    monitor.close()


def test_module_globs_do_not_cross_dots_unless_doubled():
    assert glob_match("layers.0", "layers.*")
    assert not glob_match("layers.0.linear1", "layers.*")
    assert glob_match("layers.0.linear1", "layers.**")
    assert glob_match("anything.at.all", "*")


def test_the_readme_shape_example_has_no_false_positive_on_a_transformer_encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    monitor = breakpod.watch(encoder, expect={"layers.*": "B,T,16"})
    encoder(torch.randn(3, 5, 16)).sum().backward()
    monitor.step()
    assert [a for a in monitor.anomalies if a.check == "shape"] == []
    monitor.close()


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"model": None}, "expected a torch.nn.Module, got NoneType"),
        ({"expect": "B,4"}, "expected a mapping of module names to shapes"),
        ({"optimizer": 5}, "expected a torch.optim.Optimizer, got int"),
        ({"rules": "a\0b"}, "a path cannot hold a NUL character"),
        ({"rules": "/dev/zero"}, "larger than 1 MiB"),  # was: read until memory ran out
    ],
)
def test_what_watch_is_given_is_checked_with_a_plain_message(arguments, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        breakpod.watch(**{"model": torch.nn.Linear(2, 2), **arguments})
