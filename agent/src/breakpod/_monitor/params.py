"""A monitor's parameters: which it watches (by the rules that match their modules),
how their norms and their gradients' norms are taken (planned once, planned again
when the model's parameters are replaced), and the state checks at each read."""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any

from breakpod._monitor import checks
from breakpod._monitor.baselines import NormBaselines
from breakpod._monitor.detect import Detector, ParamInfo
from breakpod._monitor.norms import NormPlan
from breakpod._monitor.peers import ddp_in, replicas_of, running_ddp
from breakpod._monitor.reporting import Reporting
from breakpod._monitor.root_hooks import layers
from breakpod._monitor.rules import Rule
from breakpod._monitor.sharding import local, sharded, sharding_of
from breakpod._monitor.stats import Entry, StepRecord, by_device
from breakpod._monitor.tiers import SENTINEL

REPLACED_EVERY = 64  # gradient collections between looks for replaced parameters
PROBED = 4  # parameters whose version counters tell that an update was applied
SLOW_STEPS = 10  # the sentinel's default BatchNorm rule reads the statistics once in this many


class ParamPlanning(Reporting):
    """The rules each module and parameter falls under, and the parameters' norms."""

    def _rules_for(
        self, checks_: Sequence[str], name: str, module: Any, where: str | None = None
    ) -> frozenset[str]:
        names = frozenset(
            r.name
            for r in self.rules
            if r.check in checks_
            and (where is None or r.check != "nonfinite" or _nonfinite_applies(r, where, module))
            and r.matches(name, module)
        )
        return self._shared(names)

    def _shared(self, names: frozenset[str]) -> frozenset[str]:
        """One object per distinct set of rule names, not one per module (hundreds)."""
        return self._rule_sets.setdefault(names, names)

    def _plan_params(self) -> None:
        """The watched parameters and how their norms, and their gradients', are taken."""
        self._params = self._watched_params()
        state = [
            (i, p)
            for i, (info, p) in enumerate(self._params)
            if _watches_params(info, self.rules, sentinel=self.tier == SENTINEL)
        ]
        params = [p for _, p in self._params]
        # sharded (FSDP): a rank's norms are its shards', summed over the ranks for the
        # gradients (every rank judges the full norms alike); a parameter's are its own.
        # Not a probe's: one rank alone may start one (the detailed tier after a NaN loss
        # of its own), and its all-reduce would wait for ranks that make none (a hang)
        self._sharding = None if self._is_probe else sharding_of(self.model, params)
        self._sharded = sharded(params)
        self._grad_norms = NormPlan([local(p) for p in params])
        self._param_norms = NormPlan([local(p) for _, p in state], keys=[i for i, _ in state])
        self._state_params = [p for _, p in state]
        batchnorm = [r for r in self.rules if r.check == "batchnorm"]
        self._bn_slow = self.tier == SENTINEL and all(r.default for r in batchnorm)
        self._bn_read = -SLOW_STEPS  # the step whose read last took the statistics
        self._missing_grads = 0  # watched parameters without a gradient at the last backward
        self._grad_reads = 0  # gradient collections since
        # built on the meta device: no values until to_empty() replaces them
        self._on_meta = any(p.is_meta for _, p in self._params)

    def _replaced_params(self, grads: list[Any]) -> bool:
        """Were parameters replaced since they were planned (``load_state_dict(assign=True)``,
        ``to_empty()`` after building on the meta device)? The old ones stop getting
        gradients, so this looks when more of them than before have none, and every
        :data:`REPLACED_EVERY` collections in case that came when none had any."""
        if not self._sharded and sharded((self._params[0][1], self._params[-1][1])):
            return True  # wrapped by FSDP1 since (watch() came first): the same parameters
        grew = False
        if self._current.grads_done:  # a step without a backward (evaluation) says nothing
            missing = sum(g is None for g in grads)
            grew, self._missing_grads = missing > self._missing_grads, missing
        self._grad_reads += 1
        if not (grew or self._on_meta) and self._grad_reads % REPLACED_EVERY:
            return False
        now = dict(self.model.named_parameters())
        return any(now.get(info.name) is not p for info, p in self._params)

    def _replan_params(self) -> None:
        """Plan for the parameters the model holds now; the detector keeps its baselines
        when they go by the same names."""
        before = [info for info, _ in self._params]
        self._plan_params()
        infos = [info for info, _ in self._params]
        if infos != before:
            self._detector = Detector(self.rules, infos, self._batchnorm, self._norm_source)

    def _baselines(self, rule: Rule) -> NormBaselines:
        """A ``grad_norm`` rule's baselines, for the gate's copy on the device (the
        detector's of the moment: a lazy module's parameters plan a new one)."""
        return self._detector.baselines(rule)

    def _norm_source(self, phase: str, step: int, index: int) -> Any:
        """The tensor behind a non-finite norm, to tell NaN/Inf from an overflow: the
        parameter, or its gradient while it is still that step's (judged at its own
        boundary, before another backward)."""
        _, param = self._params[index]
        if phase == "param":
            return local(param)
        if self._sharded:  # the norm is the ranks' together: this shard may not hold it
            return None
        fresh = step == self.step_count - 1 and not self._current.grads_done
        return param.grad if fresh else None

    def _watched_params(self) -> list[tuple[ParamInfo, Any]]:
        """Parameters whose owning module some gradient or parameter rule watches."""
        watched = []
        for name, param in self.model.named_parameters():
            owner = name.rpartition(".")[0]
            module = self.model.get_submodule(owner)
            rules = self._shared(
                self._rules_for(("grad_norm",), owner, module)
                | self._rules_for(("nonfinite",), owner, module, "param-gradient")
                | self._rules_for(("nonfinite",), owner, module, "param")
            )
            if rules:
                watched.append((ParamInfo(name, owner, rules), param))
        return watched

    def _collect_grads(self) -> None:
        """The norms of every watched gradient (``NormPlan``); a later backward in the step
        replaces them."""
        entries = [e for e in self._current.entries if e.kind != "grads"]
        grads = [p.grad for _, p in self._params]
        if self._replaced_params(grads):
            self._replan_params()
            grads = [p.grad for _, p in self._params]
        parts = self._grad_norms([local(g) for g in grads] if self._sharded else grads)
        if self._sharding is not None:
            parts = self._sharding.full(parts)
        for _, keys, norms in parts:
            entries.append(Entry("grads", norms, keys=keys))
        self._current.entries = entries
        present = (p for g, (_, p) in zip(grads, self._params, strict=True) if g is not None)
        if self._optimizer is None:  # to tell, at a skip, whether an update came since
            self._probe = [(p, p._version) for p in itertools.islice(present, PROBED)]
        else:  # to tell, at the next backward, whether zero_grad() came between (hooks.py)
            first = next(present, None)
            seen = None if first is None else (first, weakref.ref(first.grad), first.grad._version)
            self._grad_seen = seen
            self._scale_seen = self._scaling.updates()

    def _note_backward_start(self) -> None:
        """Before a backward writes any gradient: was the one seen written since the last
        backward (zeroed in place)? See :meth:`_update_skipped`."""
        seen = self._grad_seen
        if seen is not None:
            grad = seen[0].grad
            self._zeroed = grad is not None and grad._version != seen[2]

    def _update_skipped(self) -> bool:
        """With ``optimizer=``, did the loop skip the update of a step whose gradients were
        non-finite (a GradScaler that found an inf, a loop's own check)? Steps end at the
        optimizer's step, which never came. Told by the gradients: ``zero_grad()`` dropped
        them since the last backward, which made new ones (accumulating keeps them), or
        zeroed them in place (``zero_grad(set_to_none=False)``: written between the two
        backwards, where accumulation writes only within one), or a GradScaler's
        ``update()`` ran since (accumulation calls none); and the last backward's norms
        were non-finite (a read, on this rare path only)."""
        if self._optimizer is None or self._grad_seen is None:
            return False
        param, seen, _ = self._grad_seen
        grad = param.grad
        if grad is None:
            return False
        kept = not self._zeroed and grad is seen()
        if kept and self._scaling.updates() in (None, self._scale_seen):
            return False
        return not self._norms_finite()

    def _norms_finite(self) -> bool:
        """Are this step's gradient norms finite? On a GPU, a host read."""
        return norms_finite(self._grad_vectors())

    def _grad_vectors(self) -> list[Any]:
        """This step's gradient norms as collected: a vector per device and group."""
        return [e.vec for e in self._current.entries if e.kind == "grads"]

    def _add_state_checks(self, step: StepRecord) -> None:
        """Parameters and BatchNorm buffers persist, so they are checked only at reads."""
        if self._state_params and not self._on_meta:
            state = self._state_params
            for _, keys, norms in self._param_norms(
                [local(p) for p in state] if self._sharded else state
            ):
                step.entries.append(Entry("params", norms, keys=keys))
        if not self._bn_modules or not self._bn_due(step):
            return
        for _, group in by_device(self._bn_modules, lambda item: item[1].running_var).items():
            step.entries.append(
                Entry(
                    "batchnorm",
                    checks.batchnorm_stats([m for _, m in group]),
                    keys=[n for n, _ in group],
                )
            )

    def _bn_due(self, step: StepRecord) -> bool:
        """Are the running statistics read with this step? At every read, but for the
        sentinel's default rule: its ranges are crossed by a drift over many steps, and a
        NaN in them comes with a NaN loss in the same step (one training forward makes
        both), which the sentinel sees and replays. So that rule reads them once in
        ``SLOW_STEPS`` steps, and with a step found non-finite."""
        if self._bn_slow and not step.read_now and step.step - self._bn_read < SLOW_STEPS:
            return False
        self._bn_read = step.step
        return True

    def _hear_outputs(self) -> None:
        """The model's output hook: a root hook (root_hooks.py), so a compiled model's
        backward end is heard too (else its losses would read as a step late)."""
        self._root.post.append(self._guarded("model output hook", self._on_model_output))

    def _on_model_output(self, module: Any, inputs: Any, output: Any) -> None:
        if self._peers_unknown:
            self._look_for_ddp()
        if self._aside:  # the pass inside a transform ends here: later calls are checked
            self._aside = False
            return
        out = checks.first_tensor(output)
        if out is not None and out.requires_grad:
            out.register_hook(self._on_output_grad)  # type: ignore[no-untyped-call]

    def _look_for_ddp(self) -> None:
        """In the model's forward: a model that DDP wraps, watched inside the wrapper, has
        DDP's replicas as its peers. The first forward that DDP runs settles it (compiled,
        the hook runs on the compiled wrappers, after DDP's forward: DDP is among their layers)."""
        ddp = running_ddp()
        if ddp is None and self._root.wrappers:
            ddp = ddp_in(m for wrapper in self._root.wrappers for m in layers(wrapper))
        if ddp is not None:
            self._peers_unknown = False
            self._peers = replicas_of(ddp, self.model)


def norms_finite(vectors: list[Any]) -> bool:
    """One op a vector: a NaN/Inf is its max (norms are >= 0). On a GPU, a host read."""
    return all(math.isfinite(v.max()) for v in vectors)


def _nonfinite_applies(rule: Rule, where: str, module: Any) -> bool:
    """``skip_types`` spares pass-through modules' tensors, never parameters or their grads."""
    if where == "param-gradient":
        return "gradient" in rule["where"]
    if where not in rule["where"]:
        return False
    return where in ("param", "loss") or type(module).__name__ not in rule["skip_types"]


def _watches_params(info: ParamInfo, rules: list[Rule], *, sentinel: bool) -> bool:
    """Are the parameter's values checked at each read? Not for the sentinel's default
    rule: a non-finite parameter shows in the next step's loss and gradients, and that
    step's replay names the module and lists the parameter (``nonfinite_params``), so a
    norm over every parameter at every read would buy a step at the price of a pass."""
    return any(
        r.name in info.rules
        and r.check == "nonfinite"
        and "param" in r["where"]
        and not (sentinel and r.default)
        for r in rules
    )
