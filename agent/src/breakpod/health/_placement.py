"""Device placement: the first module whose parameters and inputs disagree, named
with a one-line fix, before torch's own error (which names no module).

A forward pre-hook on each module that owns parameters compares metadata only
(``.device``, ``.dtype``): no tensor is read. Dtypes are compared between
floating tensors and not under autocast, where mixed dtypes are the point.
"""

from __future__ import annotations

from typing import Any

from breakpod._core.announce import announce


class PlacementError(RuntimeError):
    """A module got inputs on another device (or of another dtype) than its parameters."""


def placement(model: Any) -> Placement:
    """Check every forward of ``model``'s modules; ``.remove()`` takes the hooks off."""
    return Placement(model)


class Placement:
    def __init__(self, model: Any) -> None:
        self._handles = []
        for name, module in model.named_modules():
            param = next(module.parameters(recurse=False), None)
            if param is not None:
                hook = _pre_hook(name or "<model>", type(module).__name__)
                self._handles.append(module.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _pre_hook(name: str, kind: str) -> Any:
    def hook(module: Any, inputs: tuple[Any, ...]) -> None:
        param = next(module.parameters(recurse=False), None)
        if param is None:
            return
        for x in inputs:
            why = mismatch(param, x)
            if why is not None:
                message = f"module {name!r} ({kind}): {why}"
                announce(message)
                raise PlacementError(message)

    return hook


def mismatch(param: Any, x: Any) -> str | None:
    """What is wrong between a parameter and an input, with the fix; None when they agree."""
    import torch

    if not isinstance(x, torch.Tensor):
        return None
    if x.device != param.device:
        return (
            f"parameters on {param.device} but an input on {x.device}; "
            f"fix: x = x.to({str(param.device)!r}) before the call (or model.to(device))"
        )
    if not (x.is_floating_point() and param.is_floating_point()) or x.dtype == param.dtype:
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    dtype = str(param.dtype).removeprefix("torch.")
    return (
        f"parameters are {dtype} but an input is {str(x.dtype).removeprefix('torch.')}; "
        f"fix: x = x.to(torch.{dtype}) (or model.to(torch.{str(x.dtype).removeprefix('torch.')}))"
    )
