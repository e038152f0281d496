"""Device placement: the first module whose parameters and inputs disagree, named
with a one-line fix, before torch's own error (which names no module).

A forward pre-hook on each module that owns parameters compares metadata only
(``.device``, ``.dtype``): no tensor is read. Dtypes are compared between
floating tensors and not under autocast, where mixed dtypes are the point; a
0-dim CPU tensor goes anywhere (torch takes it as a scalar).

By default a mismatch is said, once a module, and the call goes on: a module may
cast or move its inputs itself (``x.to(self.weight.dtype)``, accelerate's device
hooks), and then torch runs it fine; where torch fails, its error comes right
after the line that names the module. ``strict=True`` raises :class:`PlacementError`
instead (a test that wants the job to stop there).
"""

from __future__ import annotations

from typing import Any

from breakpod._core.announce import announce


class PlacementError(RuntimeError):
    """A module got inputs on another device (or of another dtype) than its parameters."""


def placement(model: Any, *, strict: bool = False) -> Placement:
    """Check every forward of ``model``'s modules; ``.remove()`` takes the hooks off.
    A mismatch is said once a module; ``strict=True`` raises PlacementError instead."""
    return Placement(model, strict=strict)


class Placement:
    def __init__(self, model: Any, *, strict: bool = False) -> None:
        self._handles = []
        said: set[str] = set()
        for name, module in model.named_modules():
            param = next(module.parameters(recurse=False), None)
            if param is not None:
                hook = _pre_hook(name or "<model>", type(module).__name__, strict, said)
                self._handles.append(module.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _pre_hook(name: str, kind: str, strict: bool, said: set[str]) -> Any:
    def hook(module: Any, inputs: tuple[Any, ...]) -> None:
        try:
            param = next(module.parameters(recurse=False), None)
            whys = [] if param is None else [mismatch(param, x) for x in inputs]
            why = next((w for w in whys if w is not None), None)
        except Exception:  # a check of metadata that failed: never into the forward
            return
        if why is None or (not strict and name in said):
            return
        said.add(name)
        message = f"module {name!r} ({kind}): {why}"
        announce(message)
        if strict:
            raise PlacementError(message)

    return hook


def mismatch(param: Any, x: Any) -> str | None:
    """What is wrong between a parameter and an input, with the fix; None when they agree."""
    import torch

    if not isinstance(x, torch.Tensor):
        return None
    if x.device != param.device and not (x.dim() == 0 and x.device.type == "cpu"):
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
