"""Rules: files, defaults, and errors that name the rule and the field."""

from __future__ import annotations

import textwrap

import pytest
import torch

import breakpod
from breakpod._monitor.checks import ShapeContract
from breakpod._monitor.rules import CHECKS, default_rules, load_rules, parse_rule
from tests.agent.nets import Net

GOOD_YAML = """
    defaults: true
    rules:
      - name: encoder-shape
        check: shape
        modules: "fc*"
        expect: "B,16"
        action: log
      - name: grads
        check: grad_norm
        modules: ["fc1", "fc2"]
        explode_factor: 20
        group: param
        consecutive: 2
        action: [log, event]
      - name: dead_units
        check: dead_units
        module_types: [ReLU]
        max_zero_fraction: 0.9
        consecutive: 5
"""


def write(tmp_path, text):
    path = tmp_path / "rules.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_rules_file_adds_to_and_overrides_the_defaults(tmp_path):
    rules = load_rules(write(tmp_path, GOOD_YAML))
    by_name = {r.name: r for r in rules}
    assert set(by_name) == {r.name for r in default_rules()} | {"encoder-shape", "grads"}
    assert (
        by_name["dead_units"]["max_zero_fraction"] == 0.9 and by_name["dead_units"].consecutive == 5
    )
    assert by_name["grads"].actions == ("log", "event") and by_name["grads"]["group"] == "param"
    assert by_name["encoder-shape"]["expect"] == ShapeContract.parse("B,16")


def test_defaults_false_keeps_only_the_file_rules(tmp_path):
    path = write(tmp_path, "defaults: false\nrules:\n  - {check: nonfinite, where: loss}\n")
    assert [r.name for r in load_rules(path)] == ["nonfinite"]


def test_watch_reads_a_config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("BREAKPOD_MONITOR", raising=False)
    path = write(tmp_path, GOOD_YAML + "    check_every: 4\n")
    monitor = breakpod.watch(Net(), config=path)
    assert monitor.check_every == 4 and "grads" in [r.name for r in monitor.rules]


BAD = [
    ("- {name: n1, check: nan}", "rule 'n1': field 'check': 'nan' is not one of nonfinite"),
    (
        "- {name: g, check: grad_norm, explode: 3}",
        "rule 'g': field 'explode': unknown for check 'grad_norm'",
    ),
    (
        "- {name: d, check: dead_units, consecutive: three}",
        "rule 'd': field 'consecutive': expected a positive",
    ),
    (
        "- {name: a, check: nonfinite, action: page}",
        "rule 'a': field 'action': 'page' is not one of log",
    ),
    (
        "- {name: s, check: shape, modules: fc1}",
        "rule 's': field 'expect': a shape check needs a shape",
    ),
    (
        "- {name: s, check: shape, expect: 'B,T,2.5'}",
        "rule 's': field 'expect': shape 'B,T,2.5': '2.5'",
    ),
    (
        "- {name: b, check: batchnorm, var_range: [5, 1]}",
        "rule 'b': field 'var_range': low 5 is above high 1",
    ),
    (
        "- {name: w, check: nonfinite, where: [weights]}",
        "rule 'w': field 'where': expected a list from",
    ),
    ("- {name: m, check: nonfinite, modules: 3}", "rule 'm': field 'modules': expected a glob"),
    (
        "- {check: dead_units, max_zero_fraction: 2}",
        "rule #1: field 'max_zero_fraction': expected a fraction",
    ),
    (
        "- {check: nonfinite}\n- {check: nonfinite}",
        "rule 'nonfinite': field 'name': used by two rules",
    ),
    ("- just-a-string", "rule #1: expected a mapping"),
    (  # accepted, and the rule could never fire
        "- {name: g, check: grad_norm, explode_factor: .inf}",
        "rule 'g': field 'explode_factor': expected a finite number >= 0 (an infinite factor",
    ),
]


@pytest.mark.parametrize(
    ("rules", "message"), BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)]
)
def test_bad_rules_file_fails_at_watch_time_naming_rule_and_field(tmp_path, rules, message):
    path = write(tmp_path, "rules:\n" + textwrap.indent(rules, "  ") + "\n")
    model = Net()
    with pytest.raises(breakpod.RuleError) as info:
        breakpod.watch(model, path)
    assert message in str(info.value)
    assert not model.fc1._forward_hooks  # nothing half-installed


def test_unreadable_and_invalid_files_say_so(tmp_path):
    with pytest.raises(breakpod.RuleError, match="cannot read it"):
        load_rules(tmp_path / "missing.yaml")
    with pytest.raises(breakpod.RuleError, match="not valid YAML"):
        load_rules(write(tmp_path, "rules: [unclosed\n"))
    with pytest.raises(breakpod.RuleError, match="unknown top-level key"):
        load_rules({"rulez": []})


def test_rule_errors_are_config_errors_and_bad_check_every_is_refused():
    assert issubclass(breakpod.RuleError, breakpod.ConfigError)
    with pytest.raises(breakpod.ConfigError, match="check_every=0"):
        breakpod.watch(Net(), check_every=0)


@pytest.mark.parametrize(
    ("spec", "shape", "why"),
    [
        ("B,T,256", (2, 5, 256), None),
        ("B,T,256", (2, 5, 255), "dim 2 is 255, expected 256"),
        ((None, 10), (7, 10), None),
        ("N,N", (3, 4), "dim 1 is 4, but N=3 earlier in the shape"),
        ("...,4", (1, 2, 3, 4), None),
        ("...,4", (), "has 0 dims, expected (..., 4)"),
        ("B,*", (1, 2, 3), "has 3 dims, expected (B, *)"),
    ],
)
def test_shape_contracts(spec, shape, why):
    assert ShapeContract.parse(spec).mismatch(torch.Size(shape)) == why


PARAMS = [(check, key) for check, params in CHECKS.items() for key in params]


@pytest.mark.parametrize(("check", "key"), PARAMS, ids=[f"{c}.{k}" for c, k in PARAMS])
def test_every_rule_parameter_is_validated(check, key):
    with pytest.raises(breakpod.RuleError, match=f"rule 'r': field '{key}': "):
        parse_rule({"name": "r", "check": check, key: {"not": "valid"}}, 0)


def test_the_grad_norm_window_is_a_positive_integer():
    assert parse_rule({"check": "grad_norm"}, 0)["window"] == 50
    with pytest.raises(breakpod.RuleError, match="field 'window': expected a positive integer"):
        parse_rule({"check": "grad_norm", "window": 0}, 0)
