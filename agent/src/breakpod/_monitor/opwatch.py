"""Op-level instrumentation for a replay: the first op that turned finite into non-finite.

Three pieces, all installed only for the replay's duration:

* a ``TorchDispatchMode`` sees every aten op of forward and backward (autograd
  sits above it), checks outputs for non-finite values and, on the first hit,
  whether the inputs were all finite;
* a ``TorchFunctionMode`` (above autograd, where outputs have their
  ``grad_fn``) remembers which module and source line created each autograd
  node, and global module hooks keep the module path;
* a pre-hook on each node of the replayed graph tells backward ops which node
  (and so which forward module and line) they belong to.

This reads tensors on the host after every op: it is for a parked job only.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from collections.abc import Iterator
from types import FrameType
from typing import Any

from breakpod._debug.pdb_commands import is_library
from breakpod._monitor.summaries import summary

# aten ops with no deterministic CUDA kernel (torch.use_deterministic_algorithms' list).
NONDETERMINISTIC_CUDA = frozenset(
    {
        *("index_add", "index_copy", "index_put", "put", "scatter_add", "scatter_reduce"),
        *("embedding_dense_backward", "_embedding_bag_dense_backward", "embedding_bag"),
        *("cumsum", "histc", "bincount", "kthvalue", "median", "nll_loss2d_forward"),
        *("upsample_linear1d_backward", "upsample_bilinear2d_backward"),
        *("upsample_bicubic2d_backward", "upsample_trilinear3d_backward"),
        *("adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward"),
        *(
            "adaptive_max_pool2d_backward",
            "avg_pool3d_backward",
            "max_pool3d_with_indices_backward",
        ),
        *("grid_sampler_2d_backward", "grid_sampler_3d_backward", "_ctc_loss_backward"),
        *("_scaled_dot_product_efficient_attention_backward", "_efficient_attention_backward"),
        *("_scaled_dot_product_flash_attention_backward", "_flash_attention_backward"),
        *("reflection_pad1d_backward", "reflection_pad2d_backward", "replication_pad2d_backward"),
    }
)
# Ops whose output is memory not yet written: garbage, never a finding.
UNINITIALISED = ("empty", "new_empty")
_STDLIB = os.path.normpath(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass
class BadOp:
    """The first op whose output went non-finite (``born``: while its inputs were finite)."""

    op: str
    phase: str
    module: str
    source: str
    node: str
    inputs: list[str]
    output: str
    born: bool

    def lines(self) -> list[str]:
        where = f"module '{self.module}'" if self.module else "the model's root"
        node = f", autograd node {self.node}" if self.node else ""
        head = (
            "first non-finite op" if self.born else "first non-finite output (inputs already bad)"
        )
        return [
            f"{head}: {self.op} ({self.phase}{node}) in {where} at {self.source}",
            *(f"  input {i}: {s}" for i, s in enumerate(self.inputs)),
            f"  output: {self.output}",
        ]


class OpWatch:
    """Instrumentation for one replay; ``with watch.forward(model): ...`` then ``.backward()``."""

    def __init__(self, model: Any, stop: FrameType | None) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stop = stop  # user frames are looked for inside the replay only
        self.phase = "forward"
        self.modules: list[str] = []
        self.origin: dict[Any, tuple[str, str]] = {}  # autograd node -> (module, source)
        self.current_node: tuple[str, str, str] | None = None
        self.first: BadOp | None = None
        self.first_any: BadOp | None = None
        self.nondeterministic: list[str] = []
        self.ops = 0

    # -- where an op comes from
    def module(self) -> str:
        return self.modules[-1] if self.modules else ""

    def source(self) -> str:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame is not self.stop:
            path = os.path.normpath(frame.f_code.co_filename)
            if not is_library(frame) and not path.startswith(_STDLIB):
                return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return "<no user source line>"

    def location(self) -> tuple[str, str, str]:
        """(module, source, node) of the op running now."""
        source = self.source()
        if self.phase == "forward" or self.current_node is None:
            return self.module(), source, ""
        node, module, forward_source = self.current_node
        return module, source if source != "<no user source line>" else forward_source, node

    # -- checks, called by the modes
    def before(self, func: Any, args: Any, kwargs: Any) -> bool | None:
        """For an op that writes into its inputs, were they finite before it ran?"""
        if self.first is not None or not _mutates(func):
            return None
        return _all_finite(_floats((args, kwargs)))

    def saw(self, func: Any, args: Any, kwargs: Any, out: Any, finite_before: bool | None) -> None:
        self.ops += 1
        name = func._schema.name.removeprefix("aten::")
        fresh = name in NONDETERMINISTIC_CUDA and name not in self.nondeterministic
        if fresh and any(t.is_cuda for t in _tensors(out)):
            self.nondeterministic.append(name)
        if self.first is not None or name.startswith(UNINITIALISED):
            return
        outs = _floats(out)
        if _all_finite(outs):
            return
        ins = _floats((args, kwargs))
        born = _all_finite(ins) if finite_before is None else finite_before
        module, source, node = self.location()
        shown = "(written in place) " if finite_before is not None else ""
        bad = BadOp(
            str(func),
            self.phase,
            module,
            source,
            node,
            [shown + summary(t) for t in ins],
            summary(outs[0]),
            born,
        )
        if born:
            self.first = bad
        elif self.first_any is None:
            self.first_any = bad

    def remember_nodes(self, args: Any, out: Any) -> None:
        """Forward, above autograd: which module and line created each node."""
        here = (self.module(), self.source())
        for t in _tensors(out):
            if t.grad_fn is not None and t.grad_fn not in self.origin:
                self.origin[t.grad_fn] = here
        for t in _tensors(args):  # nodes no function mode saw (custom autograd.Function)
            if t.grad_fn is not None and t.grad_fn not in self.origin:
                self.origin[t.grad_fn] = here

    def hook_graph(self, roots: list[Any]) -> list[Any]:
        """A pre-hook on every node reachable from ``roots``: backward ops learn their node."""
        handles, seen, todo = [], set(), [r for r in roots if r is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            module, source = self.origin.get(node, ("", "<no user source line>"))
            info = (node.name(), module, source)
            handles.append(node.register_prehook(_entered(self, info)))
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return handles


def _entered(watch: OpWatch, info: tuple[str, str, str]) -> Any:
    def prehook(grad_outputs: Any) -> None:
        watch.current_node = info

    return prehook


def _floats(value: Any) -> list[Any]:
    return [t for t in _tensors(value) if t.is_floating_point() or t.is_complex()]


def _all_finite(tensors: list[Any]) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _mutates(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _tensors(value: Any) -> Iterator[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return (t for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def modes(watch: OpWatch) -> tuple[Any, Any]:
    """The (function mode, dispatch mode) pair that feeds ``watch``."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if watch.phase == "forward":
                watch.remember_nodes((args, kwargs), out)
            return out

    class Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            finite_before = watch.before(func, args, kwargs or {})
            out = func(*args, **(kwargs or {}))
            watch.saw(func, args, kwargs or {}, out, finite_before)
            return out

    return Functions(), Ops()  # type: ignore[no-untyped-call]


def module_tracking(watch: OpWatch) -> list[Any]:
    """Global forward hooks (removed after the replay) that keep the module path."""
    from torch.nn.modules import module as nn_module

    def enter(module: Any, args: Any) -> None:
        watch.modules.append(watch.names.get(id(module), type(module).__name__))

    def leave(module: Any, args: Any, output: Any) -> None:
        if watch.modules:
            watch.modules.pop()

    return [
        nn_module.register_module_forward_pre_hook(enter),
        nn_module.register_module_forward_hook(leave),
    ]
