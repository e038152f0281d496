"""Bounds on what an event may carry, and the walkers that check them.

An event's ``fields`` are free-form JSON from the agent. They are bounded in
depth (a deeply nested document would make every later read that covers it
fail) and in size, and NaN / infinities are made strings (JSON has no such
numbers). Every walker here is iterative: no input can exhaust the stack.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 32  # containers nested inside an event's fields
MAX_FIELDS_BYTES = 64 * 1024  # an event's fields as JSON; the agent caps whole events so


def too_deep(value: Any, limit: int = MAX_DEPTH) -> list[Any] | None:
    """The path of the first container nested more than ``limit`` deep, else None."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if len(path) > limit:
            return path
        stack.extend((child, [*path, key]) for key, child in children)
    return None


def dotted(path: list[Any]) -> str:
    """``["a", 0, "b"]`` -> ``"a.0.b"``, shortened past the first few parts."""
    parts = [str(p) for p in path]
    return ".".join(parts if len(parts) <= 8 else [*parts[:8], "..."])


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as "nan", "inf", "-inf": JSON has no such
    numbers, and Python's json writes them as invalid tokens (NaN, Infinity)."""
    root: list[Any] = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, float) and not math.isfinite(item):
            parent[key] = "nan" if math.isnan(item) else ("inf" if item > 0 else "-inf")
        elif isinstance(item, dict):
            parent[key] = mapping = dict(item)
            stack.extend((mapping, k) for k in mapping)
        elif isinstance(item, list):
            parent[key] = items = list(item)
            stack.extend((items, i) for i in range(len(items)))
    return root[0]
