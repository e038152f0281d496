"""Monitor rules: what to check, where, and what to do about it.

A rule is a mapping ``{name, check, modules, <params>, consecutive, action}``;
rules come from a list, a mapping with a ``rules`` key, or a YAML file of
either shape. The built-in defaults (:func:`default_rules`) apply unless a
source says ``defaults: false``; a user rule with a default's name replaces
it, and a default rule yields the modules a user rule of the same check
watches (one anomaly, one report). Every mistake is reported at ``watch()``
time as a :class:`RuleError` that names the rule and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from breakpod._core.errors import RuleError

ACTIONS = ("log", "event", "break", "snapshot", "stop", "skip")  # rule actions
# Actions that need the step's verdict before the optimizer applies its update.
URGENT = ("break", "stop", "skip")  # rule actions that need the answer now
WHERE = ("activation", "gradient", "param", "loss")
RELU_LIKE = ("ReLU", "ReLU6", "Threshold", "Hardtanh")
# Modules that cannot turn finite inputs (or finite gradients) into non-finite
# ones, given finite parameters (checked at every read): the producer's check
# already covers them, so nonfinite skips them and halves its cost on
# conv-bn-relu stacks. ``skip_types: []`` checks every module.
PASS_THROUGH = (
    "Sequential", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm",
    "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "RMSNorm",
    "ReLU", "ReLU6", "LeakyReLU", "Hardtanh", "Sigmoid", "Tanh", "Dropout", "Dropout1d",
    "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten", "Unflatten",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
)  # fmt: skip
COMMON = ("name", "check", "modules", "module_types", "consecutive", "action")

# check -> {param: default}; None means "off unless set".
CHECKS: dict[str, dict[str, Any]] = {
    "nonfinite": {"where": list(WHERE), "skip_types": list(PASS_THROUGH)},
    "shape": {"expect": None},
    "grad_norm": {
        "explode_factor": 50.0,
        "vanish_factor": 0.01,
        "warmup_steps": 5,
        "window": 50,
        "max_norm": None,
        "min_norm": None,
        "group": "module",
    },
    # a unit is dead when zero over the whole batch (pre_relu: <= 0, F.relu comes after)
    "dead_units": {"max_zero_fraction": 0.9, "pre_relu": False},
    "activation": {"max_mean_abs": 1e4},
    # a running variance under 1e-6 has collapsed (a constant channel)
    "batchnorm": {"mean_range": [-1e4, 1e4], "var_range": [1e-6, 1e6]},
    "loss_spike": {"factor": 10.0, "window": 50, "min_history": 10},
}

Action = str | Callable[..., Any]
# Logged, and published on the event hub (free without sinks; the broker's
# emitter is one when BREAKPOD_BROKER_URL is set).
DEFAULT_ACTIONS: tuple[Action, ...] = ("log", "event")  # rule actions


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    check: str
    modules: tuple[str, ...] = ("*",)
    module_types: tuple[str, ...] = ()
    consecutive: int = 1
    actions: tuple[Action, ...] = DEFAULT_ACTIONS
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # User rules of the same check: a default rule leaves them the modules they watch.
    yields_to: tuple[Rule, ...] = ()
    default: bool = False  # one of the built-in defaults (default_rules)

    def matches(self, name: str, module: object) -> bool:
        """Does this rule watch the module ``name`` (as in ``named_modules()``)?"""
        if any(rule.matches(name, module) for rule in self.yields_to):
            return False
        if not self.matches_name(name):
            return False
        return not self.module_types or type(module).__name__ in self.module_types

    def matches_name(self, name: str) -> bool:
        """Does a glob of ``modules`` match ``name``? ``*`` stops at dots, ``**`` crosses them."""
        label = name or "<root>"
        return any(glob_match(label, g) or glob_match(name, g) for g in self.modules)

    @property
    def yields_loss(self) -> bool:
        """A user rule of this check that watches the root module also takes the loss."""
        return any(rule.matches_name("") and not rule.module_types for rule in self.yields_to)

    @property
    def urgent(self) -> bool:
        """Must this rule be evaluated before the optimizer applies the step's update?"""
        return any(a in URGENT for a in self.actions)

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    @property
    def parks(self) -> bool:
        """Does an action need the offending tensor kept until the step boundary?"""
        return any(a in ("break", "snapshot") for a in self.actions)  # actions


@functools.cache
def _glob_regex(glob: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*|\*|\?)", glob)
    wild = {"**": ".*", "*": "[^.]*", "?": "[^.]"}
    return re.compile("".join(wild.get(p, re.escape(p)) for p in parts) + r"\Z")


def glob_match(name: str, glob: str) -> bool:
    """Module globs: ``*`` and ``?`` never cross a dot (``layers.*`` is not ``layers.0.fc``)."""
    return glob == "*" or _glob_regex(glob).match(name) is not None


def default_rules(detailed: bool = True) -> list[Rule]:
    """The rules every monitor runs unless told ``defaults: false``. The sentinel tier
    (``detailed`` False) hooks no module, so it leaves out ``dead_units``, which reads
    every ReLU's output: a ``dead_units`` rule of the user's hooks the modules it names."""
    specs: list[dict[str, Any]] = [
        {"check": "nonfinite"},
        {"check": "grad_norm"},
        {"check": "dead_units", "module_types": list(RELU_LIKE), "consecutive": 3},
        {"check": "batchnorm"},
        {"check": "loss_spike"},
    ]
    if not detailed:
        specs = [spec for spec in specs if spec["check"] != "dead_units"]
    return [dataclasses.replace(parse_rule(spec, i), default=True) for i, spec in enumerate(specs)]


def load_rules(*sources: Any, defaults: bool = True, detailed: bool = True) -> list[Rule]:
    """Rules from lists, ``{"rules": [...], "defaults": bool}`` mappings or YAML file paths.

    A later source's rule replaces an earlier one of the same name; any
    source saying ``defaults: false`` drops the built-in defaults (``detailed``: the
    detailed tier's defaults, see :func:`default_rules`).
    """
    merged: dict[str, Rule] = {}
    for source in sources:
        specs, defaults = _specs(source, defaults)
        rules = [parse_rule(spec, i) for i, spec in enumerate(specs)]
        _check_unique(rules)
        merged.update((r.name, r) for r in rules)
    users = list(merged.values())
    base = [r for r in default_rules(detailed) if r.name not in merged] if defaults else []
    base = [
        dataclasses.replace(r, yields_to=tuple(u for u in users if u.check == r.check))
        for r in base
    ]
    return base + users


def _specs(source: Any, defaults: bool) -> tuple[list[Any], bool]:
    if source is None:
        return [], defaults
    if isinstance(source, (str, os.PathLike)):
        source = read_yaml(Path(source))
    if isinstance(source, Mapping):
        unknown = set(source) - {"rules", "defaults"}
        if unknown:
            raise RuleError(
                f"rules: unknown top-level key(s) {sorted(unknown)}; use 'rules' and 'defaults'"
            )
        keep = strict_bool("rules", "defaults", source.get("defaults", True))
        return _as_list(source.get("rules") or []), defaults and keep
    return _as_list(source), defaults


def strict_bool(where: str, field: str, value: Any) -> bool:
    """YAML's true/false only: the string 'false' would be truthy."""
    if not isinstance(value, bool):
        raise RuleError(f"{where}: field {field!r}: expected true or false, got {value!r}")
    return value


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RuleError(f"rules: expected a list of rule mappings, got {type(value).__name__}")
    return list(value)


MAX_RULES_BYTES = 1 << 20


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a clear :class:`RuleError` when it cannot be read or parsed."""
    try:
        import yaml
    except ImportError:
        raise RuleError(
            f"rules file {path}: reading YAML needs PyYAML (pip install pyyaml)"
        ) from None
    if "\0" in str(path):
        raise RuleError(f"rules file {str(path)!r}: a path cannot hold a NUL character")
    try:
        with path.open("rb") as f:  # not read_text: /dev/zero or a huge file has no end
            raw = f.read(MAX_RULES_BYTES + 1)
        if len(raw) > MAX_RULES_BYTES:
            raise RuleError(f"rules file {path}: larger than {MAX_RULES_BYTES >> 20} MiB")
        return yaml.safe_load(raw.decode("utf-8"))
    except OSError as e:
        raise RuleError(f"rules file {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RuleError(
            f"rules file {path}: not UTF-8 text (byte {e.start}); save it as UTF-8"
        ) from None
    except RecursionError:
        raise RuleError(f"rules file {path}: nested too deeply to be a rules file") from None
    except yaml.YAMLError as e:
        raise RuleError(f"rules file {path}: not valid YAML: {_one_line(e)}") from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _check_unique(rules: list[Rule]) -> None:
    seen: set[str] = set()
    for rule in rules:
        if rule.name in seen:
            raise RuleError(
                f"rule {rule.name!r}: field 'name': used by two rules; names must be unique"
            )
        seen.add(rule.name)


def parse_rule(spec: Any, index: int) -> Rule:
    """Validate one rule mapping; errors name the rule and the field."""
    label = f"#{index + 1}"
    if not isinstance(spec, Mapping):
        raise RuleError(f"rule {label}: expected a mapping like {{check: nonfinite}}, got {spec!r}")
    if isinstance(spec.get("name"), str) and spec["name"]:
        label = repr(spec["name"])
    check = spec.get("check")
    if check not in CHECKS:
        raise _field(label, "check", f"{check!r} is not one of {', '.join(CHECKS)}")
    known = CHECKS[check]
    unknown = sorted(set(spec) - set(COMMON) - set(known))
    if unknown:
        raise _field(
            label, unknown[0], f"unknown for check {check!r}; known: {', '.join([*COMMON, *known])}"
        )
    params = {key: _param(label, key, spec.get(key, default)) for key, default in known.items()}
    return Rule(
        name=_name(label, spec.get("name", check)),
        check=check,
        modules=_globs(label, "modules", spec.get("modules", "*")),
        module_types=_globs(label, "module_types", spec.get("module_types", [])),
        consecutive=_positive_int(label, "consecutive", spec.get("consecutive", 1)),
        actions=_actions(label, spec.get("action", list(DEFAULT_ACTIONS))),
        params=params,
    )


def _field(label: str, field: str, why: str) -> RuleError:
    return RuleError(f"rule {label}: field {field!r}: {why}")


def _name(label: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _field(label, "name", f"expected a non-empty string, got {value!r}")
    return value


def _globs(label: str, field: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(g, str) and g for g in items):
        raise _field(
            label, field, f"expected a glob or a list of globs like 'encoder.*', got {value!r}"
        )
    return tuple(items)


def _positive_int(label: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _field(label, field, f"expected a positive integer, got {value!r}")
    return value


def _actions(label: str, value: Any) -> tuple[Action, ...]:
    items = [value] if isinstance(value, str) or callable(value) else value
    if not isinstance(items, Sequence) or not items:
        raise _field(
            label, "action", f"expected one of {', '.join(ACTIONS)} (or a list), got {value!r}"
        )
    for item in items:
        if not callable(item) and item not in ACTIONS:
            raise _field(
                label, "action", f"{item!r} is not one of {', '.join(ACTIONS)} or a callable"
            )
    return tuple(items)


def _number(label: str, field: str, value: Any, *, lo: float = -math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo:
        bound = "" if lo == -math.inf else f" >= {lo:g}"
        hint = " (YAML reads 1e-3 as a string: write 1.0e-3)" if isinstance(value, str) else ""
        raise _field(label, field, f"expected a number{bound}, got {value!r}{hint}")
    return float(value)


def _range(label: str, field: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise _field(label, field, f"expected [low, high], got {value!r}")
    low, high = (_number(label, field, v) for v in value)
    if low > high:
        raise _field(label, field, f"low {low:g} is above high {high:g}")
    return low, high


def _non_negative(label: str, field: str, value: Any) -> float:
    return _number(label, field, value, lo=0.0)


def _finite(label: str, field: str, value: Any) -> float:
    if not math.isfinite(number := _non_negative(label, field, value)):
        raise _field(
            label,
            field,
            f"expected a finite number >= 0 (an infinite factor can never fire), got {value!r}",
        )
    return number


def _fraction(label: str, field: str, value: Any) -> float:
    if not 0 < _number(label, field, value) <= 1:
        raise _field(label, field, f"expected a fraction in (0, 1], got {value!r}")
    return float(value)


def _flag(label: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _field(label, field, f"expected true or false, got {value!r}")
    return value


def _type_names(label: str, field: str, value: Any) -> frozenset[str]:
    return frozenset(_globs(label, field, value)) if value else frozenset()


def _where(label: str, field: str, value: Any) -> frozenset[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not items or any(w not in WHERE for w in items):
        raise _field(label, field, f"expected a list from {', '.join(WHERE)}, got {value!r}")
    return frozenset(items)


def _expect(label: str, field: str, value: Any) -> Any:
    if value is None:
        raise _field(label, field, "a shape check needs a shape like 'B,T,256' or [null, 10]")
    from breakpod._monitor.checks import ShapeContract

    try:
        return ShapeContract.parse(value)
    except (ValueError, TypeError) as e:
        raise _field(label, field, str(e)) from None


def _group(label: str, field: str, value: Any) -> str:
    if value not in ("module", "param", "total"):
        raise _field(label, field, f"expected module, param or total, got {value!r}")
    return str(value)


# Rule parameter -> its validator; any other parameter is a number >= 0.
_VALIDATORS: dict[str, Callable[[str, str, Any], Any]] = {
    "skip_types": _type_names,
    "where": _where,
    "expect": _expect,
    "group": _group,
    "mean_range": _range,
    "var_range": _range,
    "warmup_steps": _positive_int,
    "window": _positive_int,
    "min_history": _positive_int,
    "max_zero_fraction": _fraction,
    "explode_factor": _finite,
    "pre_relu": _flag,
}


def _param(label: str, key: str, value: Any) -> Any:
    if value is None and key != "expect":
        return None  # "off unless set"
    validate: Callable[[str, str, Any], Any] = _VALIDATORS.get(key, _non_negative)
    return validate(label, key, value)
