"""The ``torch.compile`` interaction.

Dynamo traces a module's hooks when it compiles, so hooks added *after*
``torch.compile(model)`` are not seen by the compiled graph. breakpod's
debug mode therefore turns compilation off: ``BREAKPOD_DISABLE_COMPILE=1``
exports ``TORCH_COMPILE_DISABLE=1`` (read by dynamo when it is imported)
and, if dynamo is already loaded, flips its ``disable`` switch and drops the
graphs it already compiled (they would keep running without the hooks).

Hooks never run inside a dynamo trace (they would fail on the tensor marks):
a compiled model is checked at the step boundary only (gradient norms,
parameters, the loss), and the monitor says so once.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from breakpod._core.announce import announce
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


def compiled_whole(model: Any) -> bool:
    """Was ``model`` compiled with ``fullgraph=True``? No graph break is allowed there, and
    the replay capture's root hooks are one (they run eagerly: capture.eager)."""
    if type(model).__name__ != "OptimizedModule":
        return False
    return getattr(getattr(model, "dynamo_ctx", None), "fullgraph", False) is True


def say_no_capture() -> None:
    """Why a model compiled with ``fullgraph=True`` is watched without the capture."""
    announce(
        "monitor: the model was compiled with fullgraph=True, which allows no graph break: "
        "the replay capture (whose root hooks break the graph once) is off, so a non-finite "
        "step is not localized by replay; compile without fullgraph for it"
    )


def unwrap_compiled(model: Any) -> Any:
    """The original module of a ``torch.compile``-d one, with a warning that explains why."""
    original = getattr(model, "_orig_mod", None)
    if original is None or type(model).__name__ != "OptimizedModule":
        return model
    warnings.warn(
        "breakpod.watch() got a torch.compile()-d module: hooks added after compilation are "
        "ignored by the compiled graph, so the monitors would see nothing. breakpod watches the "
        "original module instead, which only runs when compilation is off: set "
        "BREAKPOD_DISABLE_COMPILE=1 (or TORCH_COMPILE_DISABLE=1) before torch.compile, or call "
        "watch() before compiling and accept graph breaks at every hook.",
        RuntimeWarning,
        stacklevel=3,
    )
    return original
