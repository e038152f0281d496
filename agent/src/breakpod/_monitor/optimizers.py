"""The optimizer whose ``step()`` applies the update, under the wrappers people pass.

Frameworks hand the training loop a wrapper, not the optimizer that steps:
accelerate's ``AcceleratedOptimizer`` (``.optimizer``), Lightning's
``LightningOptimizer`` (``._optimizer``), an LR scheduler such as
``torch.optim.swa_utils.SWALR`` (``.optimizer``). Their ``step()`` ends in the
inner optimizer's, so its step hooks are the ones that run. A wrapper that is
itself an initialised ``torch.optim.Optimizer`` (``ZeroRedundancyOptimizer``)
is hooked as it is: torch wraps its ``step()`` with the hooks.

Pure attribute walks: no torch import, nothing raised (the caller says why once).
"""

from __future__ import annotations

from typing import Any

INNER = ("optimizer", "_optimizer")  # where the wrappers keep what they wrap
DEPTH = 4  # wrappers of wrappers (a scheduler over an AcceleratedOptimizer)


def steppable(optimizer: Any) -> tuple[Any, str | None]:
    """``(the optimizer to hook, None)``, or ``(None, why it cannot be hooked)``."""
    found = optimizer
    for _ in range(DEPTH + 1):
        if hookable(found):
            return found, None
        inner = _inner(found)
        if inner is None:
            break
        found = inner
    return None, f"{type(optimizer).__name__} is not a torch.optim.Optimizer, nor wraps one"


def hookable(optimizer: Any) -> bool:
    """An initialised torch optimizer: its step hooks run (a subclass that skipped
    ``Optimizer.__init__``, as ``AcceleratedOptimizer`` does, has no hook tables)."""
    fields = getattr(optimizer, "__dict__", {})
    return (
        "_optimizer_step_pre_hooks" in fields
        and "param_groups" in fields
        and callable(getattr(optimizer, "register_step_pre_hook", None))
    )


def _inner(wrapper: Any) -> Any:
    fields = getattr(wrapper, "__dict__", {})
    for name in INNER:
        inner = fields.get(name)
        if inner is not None and inner is not wrapper:
            return inner
    return None


def params_of(optimizer: Any) -> list[Any]:
    """The parameters an optimizer holds (none for one that is not)."""
    groups = getattr(optimizer, "param_groups", None) or []
    return [p for group in groups if isinstance(group, dict) for p in group.get("params", [])]
