"""Bounds on what an event may carry, and the walkers that check them.

An event's ``fields`` are free-form JSON from the agent. They are bounded in
depth (a deeply nested document would make every later read that covers it
fail) and in size, and hold no NaN or infinity (JSON has no such numbers: agents
send them as the strings protocol.finite makes). No string in any request holds
half of a UTF-16 pair: JSON can escape one (``"\\ud800"``), but it is no Unicode
text, and neither Redis nor a reply could carry it. Every walker here is
iterative: no input can exhaust the stack.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32  # containers nested inside an event's fields
MAX_FIELDS_BYTES = 64 * 1024  # an event's fields as JSON; the agent caps whole events so

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # in JSON text: may be half a pair
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a parsed string: a half with no other
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


def lone_surrogate(value: Any) -> list[Any] | None:
    """The path of the first string (value or key) holding half of a UTF-16 pair,
    else None."""
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return [*path, key.encode("utf-8", "backslashreplace").decode()]
                stack.append((child, [*path, key]))
        elif isinstance(item, list):
            stack.extend((child, [*path, i]) for i, child in enumerate(item))
    return None


def unpaired_in_body(body: bytes) -> list[Any] | None:
    """Where a JSON request body holds half of a UTF-16 pair (parsed only when its text
    escapes a surrogate: a pair, as ``ensure_ascii`` writes an emoji, is text), else
    None; a body that is not JSON is the route's to refuse."""
    if not SURROGATE_ESCAPE.search(body):
        return None
    try:
        return lone_surrogate(json.loads(body))
    except (ValueError, RecursionError):
        return None


def as_text(value: Any) -> Any:
    """``value`` with each half of a UTF-16 pair as U+FFFD (a record stored before
    requests were checked for them: a read never fails on one)."""
    return json.loads(_SURROGATE.sub("\ufffd", json.dumps(value, ensure_ascii=False)))
