"""The ``torch.compile`` interaction.

Per-module hooks stand aside in a dynamo trace (they would fail on the tensor marks), so
the detailed tier checks a compiled model at the step boundary only (gradient norms,
parameters, the loss) and says so once. The sentinel loses nothing: its hooks are on the
model's own call, and they leave the graph (``root_hooks.py``).

For the detailed tier's hooks, ``BREAKPOD_DISABLE_COMPILE=1`` turns compilation off: it
exports ``TORCH_COMPILE_DISABLE=1`` (read by dynamo when it is imported) and, if dynamo is
already loaded, flips its ``disable`` switch and drops the graphs it already compiled
(they would keep running without the hooks).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from breakpod._core.config import DISABLE_COMPILE_ENV, env_flag

ENV = DISABLE_COMPILE_ENV


def apply_compile_policy(environ: dict[str, str] | None = None) -> bool:
    """Disable ``torch.compile`` when ``BREAKPOD_DISABLE_COMPILE`` is true; True if it did."""
    env = os.environ if environ is None else environ
    if not env_flag(ENV, False, env):
        return False
    env["TORCH_COMPILE_DISABLE"] = "1"
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        config.disable = True  # type: ignore[attr-defined]
        _drop_compiled_code()
    return True


def _drop_compiled_code() -> None:
    """Graphs compiled before the switch are cached on the code objects and would still
    run (without breakpod's hooks): drop them so the next call runs eagerly."""
    dynamo = sys.modules.get("torch._dynamo")
    reset = getattr(dynamo, "reset", None)
    if callable(reset):
        reset()


def unwrap_compiled(model: Any, *, detailed: bool) -> Any:
    """The original module of a ``torch.compile``-d one; for the detailed tier, with a
    warning that says what its hooks miss (the sentinel's root hooks run outside the
    graph, root_hooks.py: it loses nothing)."""
    original = getattr(model, "_orig_mod", None)
    if original is None or type(model).__name__ != "OptimizedModule":
        return model
    if detailed:
        warnings.warn(
            "breakpod.watch() got a torch.compile()-d module: breakpod watches the module it "
            "compiled, but the detailed tier's per-module hooks do not run inside the compiled "
            "graph (gradient norms, parameters and the loss are still checked). For them set "
            "BREAKPOD_DISABLE_COMPILE=1 (or TORCH_COMPILE_DISABLE=1) before torch.compile.",
            RuntimeWarning,
            stacklevel=3,
        )
    return original
