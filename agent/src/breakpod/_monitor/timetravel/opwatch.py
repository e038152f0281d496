"""Op-level instrumentation for a replay: the first op that turned finite into non-finite.

The first bad op is one whose output holds a NaN its inputs did not, or whose
±Inf (from finite inputs) goes on to a NaN, to the model's output (the loss) or
to a gradient. An infinity that is consumed harmlessly is intended: the -inf of
an attention mask (``full``, ``masked_fill``, ``triu``) that ``softmax`` or
``where`` turns back into finite values is never blamed. So each ±Inf born from
finite inputs is followed: the tensors holding it (a weak table) carry its
origin op through the ops that keep it, and the origin is named only when it
reaches one of those.

Three pieces, all installed only for the replay's duration:

* a ``TorchDispatchMode`` sees every aten op of forward and backward (autograd
  sits above it), checks outputs for non-finite values and, on a hit, whether
  the inputs were finite or carried a followed infinity;
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
from breakpod._monitor.checks import finite_and_nan
from breakpod._monitor.summaries import summary
from breakpod._monitor.timetravel.capture import OWN_OPS

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
    index: int = 0  # its position among the replay's ops
    then: str = ""  # for an infinity: where it went on to do harm

    def lines(self) -> list[str]:
        head = (
            "first non-finite op" if self.born else "first non-finite output (inputs already bad)"
        )
        return [
            f"{head}: {self.where()}",
            *(f"  input {i}: {s}" for i, s in enumerate(self.inputs)),
            f"  output: {self.output}",
            *([f"  then: {self.then}"] if self.then else []),
        ]

    def where(self) -> str:
        if not self.source:  # an infinity the step started with (see follow_given)
            return self.op
        module = f"module '{self.module}'" if self.module else "the model's root"
        node = f", autograd node {self.node}" if self.node else ""
        return f"{self.op} ({self.phase}{node}) in {module} at {self.source}"


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
        self.followed = _weak_table()  # tensor holding a followed ±Inf -> the op that made it
        # tensor -> (its version, finite, holds a NaN): an op's inputs are mostly the
        # outputs of ops before it, so each value is read once, not once per use
        self._verdicts = _weak_table()
        self.outputs: list[str] = []  # the model's outputs (the loss's inputs), summarised

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
    def before(self, func: Any, args: Any, kwargs: Any) -> Inputs | None:
        """For an op that writes into its inputs: what they held before it ran."""
        if self.first is not None or not _mutates(func):
            return None
        return self._inputs(floats((args, kwargs)))

    def _inputs(self, ins: list[Any]) -> Inputs:
        bad = self._nonfinite(ins)
        origins = [self.followed[t] for t in bad if t in self.followed]
        nan = any(self._verdict(t)[1] for t in bad)
        # non-finite inputs that no followed infinity explains: the batch's, the weights'
        unexplained = len(origins) < len(bad) or nan
        first = min(origins, key=lambda op: op.index) if origins else None
        return Inputs(not bad, unexplained, first)

    def saw(self, func: Any, args: Any, kwargs: Any, out: Any, before: Inputs | None) -> None:
        self.ops += 1
        name = func._schema.name.removeprefix("aten::")
        fresh = name in NONDETERMINISTIC_CUDA and name not in self.nondeterministic
        if fresh and any(t.is_cuda for t in _tensors(out)):
            self.nondeterministic.append(name)
        if self.first is not None or name.startswith(UNINITIALISED):
            return
        outs = floats(out)
        if before is not None:  # written just now: its version moves only when the op
            for t in outs:  # returns through autograd's in-place layer, above this mode
                self._verdicts.pop(t, None)
        bad = self._nonfinite(outs)
        if not bad:
            if before is not None and self.followed:  # written finite in place: not followed
                for t in outs:
                    self.followed.pop(t, None)
            return
        ins = floats((args, kwargs))
        inputs = before if before is not None else self._inputs(ins)
        self._judge(func, ins, bad, inputs, written=before is not None)

    def _judge(
        self, func: Any, ins: list[Any], bad: list[Any], inputs: Inputs, written: bool
    ) -> None:
        """An op with non-finite outputs: born here, an infinity going on, or bad inputs."""
        nan = any(self._verdict(t)[1] for t in bad)
        if inputs.unexplained:  # already bad before this op
            if self.first_any is None:
                self.first_any = self._bad_op(func, ins, bad, False, written)
            return
        if inputs.finite:
            op = self._bad_op(func, ins, bad, True, written)
            if nan or self.phase == "backward":  # NaN from finite values, or a gradient
                self._blame(op, "")
            else:
                self._follow(bad, op)  # an infinity: harmless until it does harm
            return
        origin = inputs.origin
        if origin is None:  # not reached: non-finite inputs are followed or unexplained
            return
        if nan:
            self._blame(origin, f"became NaN at {self._here(func)}")
        elif self.phase == "backward":
            self._blame(origin, f"reached a gradient at {self._here(func)}")
        else:
            self._follow(bad, origin)

    def _nonfinite(self, tensors: list[Any]) -> list[Any]:
        return [t for t in tensors if not self._verdict(t)[0]]

    def _verdict(self, t: Any) -> tuple[bool, bool]:
        """(finite, holds a NaN) of ``t``'s values, read once per version of them."""
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version: read each time
            version = None
        seen = self._verdicts.get(t) if version is not None else None
        if seen is not None and seen[0] == version:
            return seen[1], seen[2]
        verdict = finite_and_nan(t)
        if version is not None:
            self._verdicts[t] = (version, *verdict)
        return verdict

    def follow_given(self, what: str, value: Any) -> None:
        """Infinities the step starts with (a -inf mask passed in or kept as a buffer) are
        followed like those an op makes: blamed only if they do harm; NaN stays bad."""
        for t in floats(value):
            finite, nan = self._verdict(t)
            if not finite and not nan:  # infinities only
                self.followed[t] = BadOp(what, "forward", "", "", "", [], summary(t), True)

    def reached(self, outputs: Any) -> None:
        """The model's outputs (the loss's inputs): a followed infinity there is blamed."""
        origins = [self.followed[t] for t in floats(outputs) if t in self.followed]
        if origins and self.first is None:
            self._blame(min(origins, key=lambda op: op.index), "reached the model's output")

    def _blame(self, op: BadOp, then: str) -> None:
        if self.first is None or op.index < self.first.index:
            op.then = then
            self.first = op

    def _follow(self, tensors: list[Any], origin: BadOp) -> None:
        for t in tensors:
            self.followed[t] = origin

    def _here(self, func: Any) -> str:
        module, source, node = self.location()
        return BadOp(str(func), self.phase, module, source, node, [], "", True).where()

    def _bad_op(
        self, func: Any, ins: list[Any], outs: list[Any], born: bool, written: bool
    ) -> BadOp:
        module, source, node = self.location()
        shown = "(written in place) " if written else ""
        return BadOp(
            str(func),
            self.phase,
            module,
            source,
            node,
            [shown + summary(t) for t in ins],
            summary(outs[0]),
            born,
            self.ops,
        )

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


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What an op's floating inputs held (before it ran, for an op writing into them)."""

    finite: bool
    unexplained: bool  # NaN, or ±Inf that no followed infinity explains
    origin: BadOp | None  # the earliest followed infinity among them


def _weak_table() -> Any:
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def _entered(watch: OpWatch, info: tuple[str, str, str]) -> Any:
    def prehook(grad_outputs: Any) -> None:
        watch.current_node = info

    return prehook


def floats(value: Any) -> list[Any]:
    return [t for t in _tensors(value) if t.is_floating_point() or t.is_complex()]


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
            if watch.phase == "forward" and not OWN_OPS[0]:
                watch.remember_nodes((args, kwargs), out)
            return out

    class Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            """torch wraps a mode's dispatch to keep dynamo out of it, importing
            torch._dynamo at the first op: 7-9 s on a loaded CPU, the most of a first
            replay (46 ops in 6.8 s, 0.3 s without). Without dynamo loaded, nothing
            compiled can run in the replay, so there is nothing to keep out."""
            return "torch._dynamo" in sys.modules

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if OWN_OPS[0]:  # the monitor's statistics, not the model's op
                return func(*args, **(kwargs or {}))
            before = watch.before(func, args, kwargs or {})
            out = func(*args, **(kwargs or {}))
            watch.saw(func, args, kwargs or {}, out, before)
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
