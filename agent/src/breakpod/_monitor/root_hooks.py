"""Hooks on the watched model's own call, run eagerly, under ``torch.compile`` too.

The replay capture (the step's inputs, RNG, output gradient) and the monitor's step
marks (a training pass begins, its backward ends) need the model's call as it happens,
with real tensors. Eagerly they are the model's forward hooks. Under ``torch.compile``
the model's hooks are traced into its graph, where they cannot run: run eagerly there,
a hook is a graph break, and ``fullgraph=True`` allows none (dynamo fails the call).

So inside a trace the hooks leave a mark and nothing else (an attribute write, which
dynamo replays after each call of the graph: no break, no guard), and at the next eager
moment (the step's end, or a watched gradient's accumulation) they move outside the
compiled region: onto each ``torch.compile`` wrapper (``OptimizedModule``) that runs the
model, or around the call that ``model.compile()`` compiled in place. A compiled model's
steps are captured from its second step on (a wrapper's, from its second call). A model
called only from inside a compiled function has no eager call of its own to move to: the
monitor says so, once.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.compiling import compiling_check

WRAPPERS = {  # class name -> the attribute holding the module it runs
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "_LightningModuleWrapperBase": "_forward_module",
    "OptimizedModule": "_orig_mod",
}
NOWHERE = (
    "monitor: the model runs inside a function compiled by torch.compile, where its hooks "
    "cannot run: its steps are not captured for replay, and with optimizer= a loss is "
    "judged after the update; compile the model itself (torch.compile(model) or "
    "model.compile()) for them"
)

Hook = Callable[..., None]
LOOKS = 4  # at most, a model: each is one pass over the collector's objects
_said: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose NOWHERE was said


class RootHooks:
    """The hooks on ``model``'s own call: ``pre(model, args, kwargs)`` before its forward,
    ``post(model, args, output)`` after, in the order added."""

    def __init__(self, model: Any) -> None:
        """``model`` None: the inert hooks of a watched model loaded from a file."""
        self.model = model
        self.pre: list[Hook] = []
        self.post: list[Hook] = []
        self.traced = False  # written from inside a compiled graph
        self._compiling = compiling_check()  # a constant in a trace
        # times the compiled calls that run the model were looked for (an inert one: never)
        self._looks = 0 if model is not None else LOOKS
        self._unproven = False  # moved, and no training step has told since whether they run
        # the torch.compile wrappers they run on, if any (weakly: they go when the user's do)
        self.wrappers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._outside = False  # the call outside runs the hooks: the inner ones stand aside
        self._compiled_call: Any = None  # model.compile()'s, and the call that replaced it
        self._around_call: Any = None
        self._handles: list[Any] = []
        if model is not None:
            self._handles += [
                model.register_forward_pre_hook(self._inner_pre, with_kwargs=True),
                model.register_forward_hook(self._inner_post),
            ]
            self._hear_gradients()

    @property
    def moved(self) -> bool:
        """Do the hooks run on a call outside the graph (a wrapper, model.compile()'s)?"""
        return self._around_call is not None or len(self.wrappers) > 0

    def _hear_gradients(self) -> None:
        """A watched gradient's accumulation: the one eager moment of a compiled step when
        no optimizer= or ``step()`` ends it (a lazy module's parameters, not made yet: no)."""
        from torch.nn.parameter import is_lazy

        first = next((p for p in self.model.parameters() if p.requires_grad), None)
        if first is None or is_lazy(first):
            return
        try:  # weakly: autograd's hooks escape the collector
            self._handles.append(first.register_post_accumulate_grad_hook(_settler(self)))
        except RuntimeError as e:  # a parameter type that takes no hook: the step's end only
            announce(f"monitor: no gradient hook on {type(first).__name__} ({e})")

    def _inner_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._compiling():  # constant in a trace: all the graph keeps is this write
            self.traced = True
        elif not self._outside:
            self.run_pre(args, kwargs)

    def _inner_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if self._compiling():
            self.traced = True
        elif not self._outside:
            self.run_post(args, output)

    def _outer_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._outside = True  # a graph that falls back to eager runs the inner hooks too
        self.run_pre(args, kwargs)

    def _outer_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        self._outside = False  # always called: an exception in forward clears it too
        self.traced = False  # this call's graph marked it: a mark left is another call's
        self.run_post(args, output)

    def run_pre(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for hook in self.pre:
            hook(self.model, args, kwargs)

    def run_post(self, args: tuple[Any, ...], output: Any) -> None:
        for hook in self.post:
            hook(self.model, args, output)

    def settle(self) -> None:
        """At an eager moment: a compiled call that none of the hooks' calls outside covers
        ran the model (its graph marked it), so they move onto it. A few looks at most: a
        wrapper made later (an evaluation one) is found, a compiled function never is."""
        if self.traced and self._looks < LOOKS:
            self.move_outside()

    def move_outside(self) -> bool:
        """Move the hooks onto the compiled calls that run the model, if there are any (also
        for a graph compiled before the hooks, which dynamo does not retrace for them);
        True if they moved now."""
        if self._looks >= LOOKS:
            return False
        self._looks += 1
        traced, self.traced = self.traced, False
        try:
            now = self._onto_compiled_calls(traced)
        except Exception as e:  # never into training: the steps go uncaptured
            announce(f"monitor: the model's hooks could not leave its compiled graph ({e})")
            now = False
        self._unproven |= now
        return now

    def give_a_step(self) -> bool:
        """A training step ran and the hooks did not see it: were they just moved (give
        them a step to run where they went), or can they move now? False when they run
        nowhere the model's training passes go: a wrapper no one calls (Lightning compiles
        ``training_step``, not the module), a compiled function."""
        if self._unproven:
            self._unproven = False
            return True
        return self.move_outside()

    def _onto_compiled_calls(self, traced: bool) -> bool:
        compiled_call = getattr(self.model, "_compiled_call_impl", None)
        if compiled_call is not None and compiled_call is not self._around_call:
            # model.compile(): the model's own call is compiled
            self._compiled_call, self._around_call = compiled_call, self._around(compiled_call)
            self.model._compiled_call_impl = self._around_call
            return True
        new = [w for w in compiled_wrappers(self.model) if w not in self.wrappers]
        if not new and traced and not self.moved and self.model not in _said:
            _said.add(self.model)  # once a model, not again for its detailed probe
            announce(NOWHERE)
        for wrapper in new:  # a training one, an evaluation one
            self.wrappers.add(wrapper)
            self._handles += [
                wrapper.register_forward_pre_hook(self._outer_pre, with_kwargs=True),
                wrapper.register_forward_hook(self._outer_post, always_call=True),
            ]
        return bool(new)

    def _around(self, compiled_call: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._outer_pre(self.model, args, kwargs)
            output = None
            try:
                output = compiled_call(*args, **kwargs)
            finally:
                self._outer_post(self.model, args, output)
            return output

        return call

    def __reduce__(self) -> tuple[type[RootHooks], tuple[None]]:
        """Saved with its model (``torch.save(model)``): the loaded model is not watched,
        and its hooks do nothing."""
        return RootHooks, (None,)

    def __deepcopy__(self, memo: dict[int, Any]) -> RootHooks:
        """A deep copy of the model (an EMA copy) shares the hooks, as it shares the
        monitor's module hooks: its no_grad passes are told from training ones alike."""
        return self

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        around = self._around_call
        if around is not None and self.model.__dict__.get("_compiled_call_impl") is around:
            self.model._compiled_call_impl = self._compiled_call  # (not compiled since)
        self.pre.clear()
        self.post.clear()


def _settler(root: RootHooks) -> Callable[[Any], None]:
    """A gradient hook that settles ``root`` while it lives (it never keeps it alive: the
    hook sits in autograd's C++ node, where the collector cannot see a cycle through it)."""
    ref = weakref.ref(root)

    def settle(param: Any) -> None:
        live = ref()
        if live is not None:
            live.settle()

    return settle


def compiled_wrappers(model: Any) -> list[Any]:
    """The ``torch.compile`` wrappers that run ``model`` (through DDP's too). Found by one
    pass over the collector's objects (75 ms in a process that imported transformers):
    once a job, at its first compiled step."""
    wrapper_type = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if wrapper_type is None:
        return []
    return [wrapper for wrapper in live_instances(wrapper_type) if _runs(wrapper, model)]


def live_instances(cls: type) -> Iterator[Any]:
    """Every object of ``cls`` (or a subclass) that the collector tracks: one pass over
    them all. Told by type, not isinstance(): a dead weakproxy raises there, and a
    deprecated torch alias warns."""
    return (found for found in gc.get_objects() if issubclass(type(found), cls))


def layers(model: Any) -> list[Any]:
    """``model`` and the modules its wrappers run, outermost first (at most four deep)."""
    found = [model]
    for _ in range(4):
        inner = getattr(found[-1], WRAPPERS.get(type(found[-1]).__name__, ""), None)
        if inner is None:
            break
        found.append(inner)
    return found


def _runs(wrapper: Any, model: Any) -> bool:
    """Does ``wrapper`` run ``model`` itself, through wrappers only (never a larger model)?"""
    return any(layer is model for layer in layers(wrapper)[1:])
