"""Is a ``torch.compile`` trace running? Dynamo traces the hooks breakpod puts on a model,
its modules and its optimizer; a hook that writes a dict, takes a lock or reads a clock
there fails a ``fullgraph=True`` compile, or breaks the graph. Each such hook asks first:
inside a trace the answer is a constant, so the question traces to nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable


def compiling_check() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``, to look up once per hook and call per run; one that
    is never true where torch is not loaded."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return check if check is not None else _never


def _never() -> bool:
    return False
