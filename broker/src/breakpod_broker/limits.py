"""Bounds on what an event may carry, and the walkers that check them.

An event's ``fields`` are free-form JSON from the agent. They are bounded in
depth (a deeply nested document would make every later read that covers it
fail) and in size, and hold no NaN or infinity (JSON has no such numbers: agents
send them as the strings protocol.finite makes). Every walker here is iterative:
no input can exhaust the stack.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 32  # containers nested inside an event's fields
MAX_FIELDS_BYTES = 64 * 1024  # an event's fields as JSON; the agent caps whole events so

_CONTAINERS = (dict, list)  # a tuple: ``dict | list`` makes a union at every call


def too_deep(value: Any, limit: int = MAX_DEPTH) -> list[Any] | None:
    """The path of the first container nested more than ``limit`` deep, else None.
    (Only containers are walked, each with its depth and a link to its parent: the
    path is built for the one found. It runs on every event ingested or decoded.)"""
    stack: list[tuple[Any, int, Any]] = [(value, 0, None)]
    while stack:
        item, depth, link = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if depth > limit:
            return _path(link)
        for key, child in children:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1, (link, key)))
    return None


def _path(link: Any) -> list[Any]:
    path: list[Any] = []
    while link is not None:
        link, key = link
        path.append(key)
    path.reverse()
    return path


def dotted(path: list[Any]) -> str:
    """``["a", 0, "b"]`` -> ``"a.0.b"``, shortened past the first few parts."""
    parts = [str(p) for p in path]
    return ".".join(parts if len(parts) <= 8 else [*parts[:8], "..."])


def nonfinite(value: Any) -> list[Any] | None:
    """The path of the first NaN or infinity in ``value``, else None."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path
        if isinstance(item, dict):
            stack.extend((child, [*path, key]) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, [*path, i]) for i, child in enumerate(item))
    return None
