"""A monitor's module hooks: each watched module's output and the gradient w.r.t. its
input handed to the step's statistics on the device, the batch checked at the model's
input, the end of each backward queued, and shape contracts checked from metadata."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

from breakpod._core.compiling import compiling_check
from breakpod._core.errors import AnomalyError
from breakpod._monitor import checks, staging
from breakpod._monitor.contracts import ShapeContracts, _shapes
from breakpod._monitor.detect import Slot
from breakpod._monitor.peers import in_synced_ddp_forward
from breakpod._monitor.rules import Rule
from breakpod._monitor.state import Shapes
from breakpod._monitor.stats import StepRecord
from breakpod._monitor.tiers import DETAILED, OUTPUT_CHECKS, sentinel_blind
from breakpod._monitor.timetravel.capture import REPLAYING, as_own

ACTIVATION_CHECKS = ("nonfinite", "activation", "dead_units")


class ModuleHooks(ShapeContracts):
    """Forward hooks and input-gradient hooks on the watched modules (the hot path)."""

    def _watch_module(self, name: str, module: Any) -> None:
        detailed = self.tier == DETAILED
        # the sentinel tier hooks a module only for a rule that reads its outputs
        fwd_checks = ACTIVATION_CHECKS if detailed else OUTPUT_CHECKS
        fwd = self._rules_for(fwd_checks, name, module, "activation")
        if not detailed:
            blind = {r.name for r in self.rules if sentinel_blind(r)}
            nonfinite = self._rules_for(("nonfinite",), name, module, "activation")
            fwd = self._shared(fwd | (nonfinite & blind))
        bwd = self._rules_for(("nonfinite",), name, module, "gradient") if detailed else frozenset()
        shapes = [
            (r, r["expect"]) for r in self.rules if r.check == "shape" and r.matches(name, module)
        ]
        if not (fwd or bwd or shapes):  # shapes only (host metadata), for ``tshape``
            if detailed:
                hook = self._guarded("shape hook", functools.partial(self._record_shapes, name))
                self._handles.append(module.register_forward_hook(hook))
            return
        self._module_checks = True
        by_name = {r.name: r for r in self.rules}
        watched = [by_name[n] for n in fwd]
        slot = back = None
        if fwd:
            slot = self._new_slot(
                name,
                "forward",
                fwd,
                total=any(r.check == "nonfinite" for r in watched),
                mean_abs=any(r.check == "activation" for r in watched),
                zeros=any(r.check == "dead_units" for r in watched),
                pre_relu=any(r.check == "dead_units" and r["pre_relu"] for r in watched),
                retain=any(r.parks for r in watched),
                abs_limit=min(
                    (r["max_mean_abs"] for r in watched if r.check == "activation"),
                    default=math.inf,
                ),
                zero_limit=min(
                    (r["max_zero_fraction"] for r in watched if r.check == "dead_units"),
                    default=math.inf,
                ),
            )
        if bwd:  # input gradients: the detailed tier only
            back = self._new_slot(name, "backward", bwd, retain=any(by_name[n].parks for n in bwd))
        hook = self._forward_hook(name, module, slot, back, shapes)
        # with the call's keyword arguments: a module called as layer(hidden_states=h) has
        # its input there
        self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def _new_slot(self, name: str, phase: str, rules: frozenset[str], **flags: Any) -> Slot:
        """A slot with its columns after the previous slots' in the per-step buffer."""
        base = sum(s.width for s in self._slots)
        index, flight = len(self._slots), self._flight_columns
        slot = Slot(name, phase, rules, index=index, base=base, flight=flight, **flags)
        self._slots.append(slot)
        return slot

    def _install_input_hook(self) -> None:
        """A pre-hook on the model: the batch is checked (a non-finite batch is the data's
        fault, not the first module's), and a no_grad pass never mixes into a training step."""
        import torch

        self._grad_enabled = torch.is_grad_enabled
        self._pass = 0  # forward passes of the model so far (see _claim)
        self._aside = False  # this pass runs inside a torch.func transform (_in_transform)
        self._tensor = torch.Tensor
        self._strided = torch.strided
        # dtypes the statistics read as they are (all others: checks.as_float32)
        self._native = frozenset((torch.float32, torch.bfloat16, torch.float16))
        self._ignore_pass = False
        self._input_slot: Slot | None = None
        if self._module_checks:
            self._plan_input_slot()
        # always: a training pass is where a step begins (see record_loss)
        self._root.pre.append(self._guarded("model input hook", self._on_model_input))

    def _plan_input_slot(self) -> None:
        batch_rules = frozenset(
            r.name
            for r in self.rules
            if r.check == "nonfinite"
            and "activation" in r["where"]
            and any(r.name in s.rules for s in self._slots if s.phase == "forward")
        )
        if batch_rules:
            parks = any(r.parks for r in self.rules if r.name in batch_rules)
            self._input_slot = self._new_slot("", "input", batch_rules, retain=parks)

    def _on_model_input(self, module: Any, inputs: tuple[Any, ...], kwargs: Any) -> None:
        self._pass += 1  # a claim holds for one pass: a module may return one tensor each step
        training = self._grad_enabled()
        if training:
            self._updated = False  # a training pass: the next step has begun (see record_loss)
        if not self._module_checks:
            return
        self._aside = _in_transform()  # the module hooks do nothing in this pass
        if self._aside:
            return
        if training and self.tier == DETAILED and in_synced_ddp_forward():
            # its gradients come back averaged (detect.py; the detailed tier's hooks check
            # every module, so a finite forward on this rank is known)
            self._current.averaged = True
        self._sort_pass(self._current)
        slot = self._input_slot
        # the first tensor only: a later argument may hold -inf by design (an attention mask)
        x = checks.first_tensor(inputs) if slot is not None and not self._ignore_pass else None
        if slot is not None and x is not None and (x.is_floating_point() or x.is_complex()):
            self._write_stats(slot, x)

    def _sort_pass(self, record: StepRecord) -> None:
        """Evaluation under no_grad is not the training step: a training pass drops the
        stats of an evaluation pass before it, and an evaluation pass after training
        stats in the same step records nothing. Only no_grad passes (inference) count."""
        if self._grad_enabled():
            self._ignore_pass = False
            if record.eval_only:
                self._stager.drop()
                record.ran.clear()
                record.units.clear()
                record.kept.clear()
                record.eval_only = False
        elif not record.ran:
            self._ignore_pass, record.eval_only = False, True
        else:
            self._ignore_pass = not record.eval_only

    def _install_grad_hooks(self) -> None:
        """One hook on the model's output queues the end-of-backward gradient norms (its
        gradient is a backward's first); with no backward through it, ``step`` does."""
        if self._params:
            self._hear_outputs()
        self._on_output_grad = self._guarded("output gradient hook", self._queue_backward_end)
        self._backward_end = self._guarded("gradient norms", self._on_backward_end)
        self._backward_last = self._guarded("gradient norms", self._queue_last)

    # ------------------------------------------------------------------ hooks (hot path)
    # A forward hook runs for every watched module in every step and a gradient hook for
    # every watched input in every backward; on a CPU a model of hundreds of small modules
    # pays their Python on each call. So each hook is one closure with its module's state
    # bound at install: no partials, no per-call tuples or closures, few lookups on self.
    # Nor do they keep new objects past the call (the shapes are stored only when they
    # change): objects that outlive a step's collections of the young generation die
    # old, and enough of them bring on a full collection, a pass over every object of
    # a process that imported torch (200 ms and more).
    def _forward_hook(
        self,
        name: str,
        module: Any,
        slot: Slot | None,
        back: Slot | None,
        shapes: list[tuple[Rule, Any]],
    ) -> Callable[..., None]:
        import torch

        tensor_type = torch.Tensor
        # outputs >= 0 (or NaN) by construction: dead units take one cheap max (checks.py)
        nonnegative = type(module) in (torch.nn.ReLU, torch.nn.ReLU6)
        mode = staging.unit_mode(slot, nonnegative) if slot is not None else ""
        # SiLU(inplace=True) and the like: they change their input and return it (dropout
        # need not: in evaluation, or with p=0, it returns its input untouched)
        inplace = getattr(module, "inplace", False) is True and not isinstance(
            module, torch.nn.modules.dropout._DropoutNd
        )
        # output index -> node pre-hook (-1: the tensor hook of a leaf input)
        grad_hooks: dict[int, Callable[[Any], None]] = {}
        seen = self.shapes
        fwd_marks = self._fwd_marks
        compiling = compiling_check()

        def hook(module: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # see _guarded (a probe's hooks see replays), _in_transform
            if compiling() or (REPLAYING[0] and not self._sees_replay) or self._aside:
                return
            try:
                out = output if isinstance(output, tensor_type) else checks.first_tensor(output)
                if out is None:
                    return
                try:
                    now: Shapes = (
                        [x.shape for x in inputs if isinstance(x, tensor_type)],
                        out.shape,
                    )
                except RuntimeError:  # a nested tensor has no one shape
                    now = _shapes(inputs, out)
                if seen.get(name) != now:  # kept only on a change: see the note above
                    seen[name] = now
                if shapes and not out.is_nested:  # a contract names one size per dim
                    for rule, contract in shapes:
                        self._check_shape(name, rule, contract, out)
                if self._ignore_pass:
                    return  # an evaluation pass inside a training step
                if slot is not None:
                    # the module's first value: (mask, y) is judged on y
                    value = (
                        out
                        if out.is_floating_point() or out.is_complex()
                        else checks.first_tensor(output, values_only=True)
                    )
                    if value is not None and _claim(value, fwd_marks, name, self._pass):
                        self._write_stats(slot, value, nonnegative, mode)
                if back is not None:
                    changed = out if inplace else None
                    self._hook_inputs(name, back, grad_hooks, inputs, changed)
                    if kwargs:
                        self._hook_inputs(name, back, grad_hooks, kwargs.values(), changed)
            except AnomalyError:
                raise
            except Exception as e:
                self._fail("forward hook", e)

        return hook

    def _grad_hook(self, slot: Slot, index: int) -> Callable[[Any], None]:
        """The hook that checks the gradient w.r.t. a module's input (see _forward_hook):
        a node pre-hook given the node's output gradients, of which it takes ``index``,
        or, with ``index`` -1, a tensor hook given the gradient itself."""
        compiling = compiling_check()

        def hook(grads: Any) -> None:
            # closed: a tensor hook on a leaf (a parameter fed as an input) outlives close()
            if compiling() or (REPLAYING[0] and not self._sees_replay) or not self.enabled:
                return
            grad = grads if index < 0 else grads[index]
            if grad is None:  # an output no loss depends on has no gradient
                return
            try:
                self._write_stats(slot, grad)
                if not self._backward_queued:
                    self._queue_backward_end()
            except AnomalyError:
                raise
            except Exception as e:
                self._fail("gradient hook", e)

        return hook

    def _write_stats(self, slot: Slot, x: Any, nonnegative: bool = False, mode: str = "") -> None:
        """The slot's statistics into this step's buffer; the host notes that it ran.

        ``mode``: :func:`.staging.unit_mode` of the slot (made once per hook, not per call).
        The value is detached here, not by the hooks, so that a probe's every op is in
        :meth:`ops_are_own`'s reach.
        """
        x = x.detach()  # the value, not the graph
        if x.layout is not self._strided or x.is_nested or x.is_meta:
            x = checks.dense_values(x)  # sparse, nested, mkldnn: their values; meta: none
            if x is None:
                return
        numel = x.numel()
        if not numel:
            return  # an empty batch's tensor: no value to check
        if x.dtype not in self._native:  # float64, float8, complex: see checks.as_float32
            x = checks.as_float32(x)
            numel = x.numel()
        if slot.retain:  # as the statistics saw it: its exact counts must agree with them
            self._current.kept[slot.index] = x
        record, device = self._current, x.device
        ran = record.ran.get(device)
        index = slot.index
        if ran is not None and index in ran:  # a second call this step: the sums add
            self._add_stats(record, device, slot, x, nonnegative)
            return
        staged = self._stager.put(slot, x, mode, device, numel, not record.stats)
        if not staged:  # a large tensor: at once
            cells = self._table.cells(device)
            checks.write_stats(
                x, cells, slot.base, *slot.flags, nonnegative=nonnegative, stats=record.stats
            )
        if ran is None:  # noted once its statistics are written: a failure leaves no trace
            ran = record.ran[device] = {}
            record.units[device] = {}
        ran[index] = numel
        if slot.zeros and record.stats:
            record.units[device][index] = checks.unit_count(x.shape)

    def _add_stats(
        self, record: StepRecord, device: Any, slot: Slot, x: Any, nonnegative: bool
    ) -> None:
        scratch = x.new_zeros(slot.width, dtype=_float32())
        stats = record.stats
        checks.write_stats(
            x, scratch.unbind(), 0, *slot.flags, nonnegative=nonnegative, stats=stats
        )
        self._stager.add(device, slot, scratch)
        record.ran[device][slot.index] += x.numel()
        if slot.zeros and stats:
            record.units[device][slot.index] += checks.unit_count(x.shape)

    def _hook_inputs(
        self,
        name: str,
        slot: Slot,
        grad_hooks: dict[int, Callable[[Any], None]],
        inputs: Iterable[Any],
        changed: Any,
    ) -> None:
        """The gradient w.r.t. a module's input is what its backward produced: check it there.

        A pre-hook on the node that produced the input sees that gradient (all
        consumers' sum, as a tensor hook would) for about half the cost of
        ``Tensor.register_hook``; a leaf input has no node, so it gets a tensor hook.
        The hooks are made once per module and output index, not per call. An
        in-place module (``SiLU(inplace=True)``) returns its input, ``changed``, whose
        node is now the module's own: the input's producer is that node's first next
        function.
        """
        if not self._grad_enabled():
            return
        for x in inputs:
            if not (isinstance(x, self._tensor) and x.requires_grad):
                continue
            node = x.grad_fn
            if x is changed and node is not None and node.next_functions:
                # the producer before the change; x itself is the module's output, left
                # unclaimed for the module that reads it next
                node, index = node.next_functions[0]
                if node is None:  # the input needed no gradient before the change
                    continue
            elif _first_claim(x, self._bwd_mark, name):
                index = -1 if node is None else x.output_nr
            else:
                continue
            hook = grad_hooks.get(index)
            if hook is None:
                hook = grad_hooks[index] = self._grad_hook(slot, index)
            if node is None:  # a leaf keeps its hook across steps: removed by close()
                self._leaf_hooks[x] = x.register_hook(hook)
            else:
                node.register_prehook(hook)

    def ops_are_own(self) -> None:
        """A replay's probe: its statistics are the monitor's own tensor ops, which the
        replay's op check looks past (``capture.own_ops``). Set on the probe only, so a
        training step's hooks pay nothing for it."""
        self._write_stats = functools.partial(as_own, self._write_stats)  # type: ignore[method-assign]

    def _queue_backward_end(self, *_: Any) -> None:
        if self._backward_queued or not self._params:
            return
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(self._backward_last)
        self._backward_queued = True
        self._note_backward_start()

    def _queue_last(self) -> None:
        """Queued again from the engine's final callbacks, so that it runs after all that
        the backward queued: DDP's reducer finalizes there, writing the averaged
        gradients (the norms read before were this rank's own)."""
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(self._backward_end)

    def _on_backward_end(self) -> None:
        self._backward_queued = False
        if self._closing:  # closed while its peers still watched: have they all closed?
            self.close()
            if not self.enabled:
                return
        self._updated = False  # a backward after the update: the next step has begun
        sharding = self._sharding
        sums = sharding.sums if sharding is not None else 0
        try:
            if self._current.grads_done and self._update_skipped():
                self._end_skipped_step()
            self._current.grads_done = True
            self._collect_grads()  # (a re-plan may make a new sharding)
        finally:  # whatever failed: the other ranks wait in the norms' sum for this one's
            now = self._sharding
            if now is not None and now.sums == (sums if now is sharding else 0):
                now.full([])
        self._backward_done()

    def _end_skipped_step(self) -> None:
        """The step whose update the loop skipped ends here (pipeline.py)."""

    def close(self) -> None:
        """Remove every hook (monitor.py)."""

    def _backward_done(self) -> None:
        """After the gradients' norms: the sentinel looks at them here (sentinel.py)."""


def _in_transform() -> bool:
    """Inside a torch.func transform (``vmap``, ``grad``, ``jacrev``)? They refuse the
    hooks' writes into the step's buffers, and their tensors are not the step's. Asked
    once per pass of the model, not per module."""
    functorch = getattr(sys.modules["torch"]._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _float32() -> Any:
    import torch

    return torch.float32


def _claim(tensor: Any, marks: tuple[str, str], name: str, pass_: int) -> bool:
    """Check a tensor once a pass: a container skips what one of its submodules already
    took in this forward pass.

    The marks (the module's name, the pass) are attributes on the tensor object, so
    they live exactly as long as the tensor (an id() table could confuse a freed
    tensor with a new one). Two plain values, not a tuple: a tuple a call is an object
    the garbage collector tracks, made for every module in every step.
    """
    owner_attr, pass_attr = marks
    marked = tensor.__dict__
    owner = marked.get(owner_attr)
    taken = owner is not None and marked[pass_attr] == pass_  # in this pass
    if taken and (name == "" or owner == name or owner.startswith(name + ".")):
        return False
    marked[owner_attr], marked[pass_attr] = name, pass_
    return True


def _first_claim(tensor: Any, attr: str, name: str) -> bool:
    """One gradient hook per tensor: its gradient is the same whichever consumer hooks it."""
    if attr in tensor.__dict__:
        return False
    setattr(tensor, attr, name)
    return True
