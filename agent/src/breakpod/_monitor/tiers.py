"""The monitors' two tiers, and which one a monitor runs.

* **sentinel** (the default): no module hooks. Per step, the loss and every
  parameter gradient's norm (one fused norm per device and dtype) into one
  small device tensor, read once at the step's end; the gradient-norm rules,
  the loss rules and BatchNorm's running statistics are judged on it. A
  non-finite value found there is localized by replaying the step under the
  detailed checks (:mod:`breakpod._monitor.sentinel`).
* **detailed**: today's per-module hooks on every watched module (outputs,
  input gradients, the batch), as the sentinel's replay uses them. In the
  sentinel tier a rule that needs activations (``activation``,
  ``dead_units``, ``shape``) still hooks the modules it names, and only those.

``watch(..., tier=...)`` > ``BREAKPOD_MONITOR_TIER`` > ``sentinel``. A replay
that does not reproduce its step turns the detailed tier on for the next
``BREAKPOD_DETAILED_STEPS`` steps, so the next occurrence is localized live.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from breakpod._core.announce import announce
from breakpod._core.config import parse_int
from breakpod._core.errors import ConfigError
from breakpod._monitor.rules import Rule

TIER_ENV = "BREAKPOD_MONITOR_TIER"
DETAILED_STEPS_ENV = "BREAKPOD_DETAILED_STEPS"
SENTINEL = "sentinel"
DETAILED = "detailed"
TIERS = (SENTINEL, DETAILED)
DEFAULT_DETAILED_STEPS = 100
# Checks that read module outputs into the step's statistics: in the sentinel tier, a
# module is hooked for the rules of these (and for a shape contract) only.
OUTPUT_CHECKS = ("activation", "dead_units")
SENTINEL_SITES = frozenset(("loss", "gradient", "param"))  # where the sentinel sees values


def sentinel_blind(rule: Rule) -> bool:
    """A ``nonfinite`` rule of activations only: the sentinel sees none of its sites, so
    in the sentinel tier it hooks the modules it names, as a detailed rule."""
    return rule.check == "nonfinite" and not SENTINEL_SITES & set(rule["where"])


def tier_of(explicit: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``tier=`` > ``BREAKPOD_MONITOR_TIER`` > sentinel; anything else is one clear line."""
    env = os.environ if environ is None else environ
    value = explicit if explicit is not None else env.get(TIER_ENV, "").strip() or SENTINEL
    if value not in TIERS:
        source = "watch(tier=...)" if explicit is not None else TIER_ENV
        raise ConfigError(f"{source}={value!r}: expected one of {', '.join(TIERS)}")
    return value


def detailed_steps(environ: Mapping[str, str] | None = None) -> int:
    """Steps the detailed tier stays on after a replay that did not reproduce its step."""
    raw = (os.environ if environ is None else environ).get(DETAILED_STEPS_ENV, "").strip()
    if not raw:
        return DEFAULT_DETAILED_STEPS
    try:
        steps = parse_int(DETAILED_STEPS_ENV, raw)
        if steps < 0:
            raise ConfigError(f"{DETAILED_STEPS_ENV}={raw!r} is negative")
    except ConfigError as e:
        announce(f"{e}: expected a step count (0 = never); keeping {DEFAULT_DETAILED_STEPS}")
        return DEFAULT_DETAILED_STEPS
    return steps
