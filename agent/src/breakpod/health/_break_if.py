"""``breakpod.break_if(cond, every=N)``: park in a debugger when a condition holds.

A Python bool is tested at once. A tensor condition is folded on its device
(``acc |= cond.any()``, no host sync) and read on the host only every
``every``-th call at that line: one sync per ``every`` calls, and a condition
that held between reads is not lost. Write tensor conditions with ``|`` and
``~`` (``(loss > 10) | ~loss.isfinite()``): Python's ``or``/``not`` read the
tensor themselves.
"""

from __future__ import annotations

import sys
from types import CodeType
from typing import Any

from breakpod._debug import breakpoints

_folded: dict[tuple[CodeType, int], list[Any]] = {}  # call site -> [calls, device flag]


def break_if(cond: Any, every: int = 1, *, header: str | None = None) -> bool:
    """True when it parked (or would have, where no debugger could start)."""
    frame = sys._getframe(1)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(cond, torch.Tensor):  # a bool, a NumPy array
        return _park(frame, header) if _holds(cond) else False
    site = (frame.f_code, frame.f_lineno)
    state = _folded.setdefault(site, [0, None])
    flag = cond.detach().any()
    state[1] = flag if state[1] is None else state[1] | flag
    state[0] += 1
    if state[0] % max(every, 1):
        return False
    held, state[1] = bool(state[1]), None  # the one host read
    return _park(frame, header) if held else False


def _holds(cond: Any) -> bool:
    """A condition's truth: any element of an array (NumPy's ``bool()`` refuses one)."""
    any_ = getattr(cond, "any", None)
    return bool(any_() if callable(any_) else cond)


def _park(frame: Any, header: str | None) -> bool:
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    breakpoints.set_trace(frame=frame, header=header or f"break_if at {where}: the condition held")
    return True
