"""Gradient-norm baselines of one ``grad_norm`` rule, judged as vectors.

A model of hundreds of modules has hundreds of groups (a module's parameters,
by default); judging each in Python every step cost more than the norms
themselves. Here a step's norms become one vector: group norms by one
``index_add_``, the absolute limits, the warm-up (the median of the first
``warmup_steps`` norms, once positive, and only when they stay within
``explode_factor`` of each other: a warm-up that already explodes gives no
baseline, and one that goes non-finite starts again) and the baseline (an EMA of log norms
over about ``window`` steps, moved only by healthy steps) are all vector
operations, and Python sees only the groups that are out of range. The usual
step (no absolute limit set, every group with a baseline within its factors, the
others finite) is judged in about a dozen such operations on the norm vector as
the host copy holds it, or, for a model of a few dozen groups once each has its
baseline, in the host's floats (cheaper than the ops); only a step with something
to say goes group by group.

A group whose warm-up median is at most ``DEAD`` has no baseline: its gradients
were gone from the start (a deep stack without normalization underflows to 1e-23
and then to 0), and "0 is 0x its baseline 4e-23" is no news. Such a group is
*gone*: it stops warming up, and warms up afresh from the step its norm comes back
above ``DEAD`` (half a 200-layer MLP's groups are gone: warming them every step,
and a median over them every ``warmup_steps``, cost it 1-2% of its step). Another
group that cannot take a baseline yet (its warm-up exploded) is judged again once
per ``warmup_steps`` steps, not every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from breakpod._core.announce import announce
from breakpod._monitor.rules import Rule

EXPLODING, VANISHING = "exploding", "vanishing"
DEAD = 1e-20  # a warm-up median at most this: the group's gradients are gone (underflow)
FEW_GROUPS = 64  # up to this many groups, the usual step is judged in floats (_quiet_floats)


# a group out of range: (kind, norm, summary, how many times past the limit it crossed)
Verdict = tuple[str, float, str, float]


class Judgement(NamedTuple):
    out_of_range: dict[int, Verdict]  # group -> its verdict
    seen: list[bool]  # per group: some parameter of it had a gradient this step


class NormBaselines:
    """One rule's parameter groups: :meth:`judge` a step's gradient norms against them."""

    def __init__(self, rule: Rule, params: Sequence[Any]) -> None:
        import torch

        self.rule = rule
        group = rule["group"]
        self.ids = [i for i, info in enumerate(params) if rule.name in info.rules]
        keys = [
            {"module": params[i].module, "param": params[i].name, "total": "<total>"}[group]
            for i in self.ids
        ]
        position: dict[str, int] = {}
        for key in keys:
            position.setdefault(key, len(position))
        self.names = list(position)
        self.position = position  # group name -> its index in names
        self._groups = [position[k] for k in keys]  # each of ids' group
        self.group_of = torch.tensor(self._groups, dtype=torch.long)
        size, f64 = len(self.names), torch.float64
        self._log_base = torch.full((size,), math.nan, dtype=f64)
        self._warm = torch.full((rule["warmup_steps"], size), math.nan, dtype=f64)
        self._warmed = torch.zeros(size, dtype=torch.long)  # norms seen during warm-up
        self._alpha = 2 / (rule["window"] + 1)
        self._said = False  # an exploding warm-up was announced
        self._everyone = torch.ones(size, dtype=torch.bool)  # seen, when every id has a grad
        self._seen_all = [True] * size
        self._unbased: Any = torch.ones(size, dtype=torch.bool)  # warming up; None: no group
        self._gone = torch.zeros(size, dtype=torch.bool)  # gradients gone since the start
        self._any_gone = False
        self.judged = 0  # steps judged: the device's copy of the limits follows (norm_limits.py)
        self._keys: Sequence[int] | None = None  # the last norm vector's parameter indices
        self._order: Any = None  # where self.ids are in them (None: one is missing)
        # the log baselines as floats, newer than _log_base while not None (_quiet_floats)
        self._floats: list[float] | None = None
        self._few = size <= FEW_GROUPS

    def judge(
        self, grads: dict[int, float], vectors: Sequence[tuple[Sequence[int], Any]] = ()
    ) -> Judgement:
        """This step's groups out of range and the groups it saw; the others warm up or
        move their baselines. ``vectors``: the same norms as tensors per device
        (parameter indices, norms), taken as they are when one holds them all."""
        import torch

        out: dict[int, Verdict] = {}
        if not self.ids:
            return Judgement(out, [])
        self.judged += 1
        if self._quiet_floats(grads):
            return Judgement(out, self._seen_all)
        self._to_tensor()
        norms, everyone = self._norms(grads, vectors)
        norm = torch.zeros(len(self.names), dtype=torch.float64)  # a missing one adds 0
        norm.index_add_(0, self.group_of, norms.square()).sqrt_()
        if everyone and self._quiet(norm):
            return Judgement(out, self._seen_all)
        if everyone:
            seen = self._everyone  # every group: the usual step, a tensor less to build
        else:
            seen = torch.zeros(len(self.names), dtype=torch.bool)
            seen[self.group_of[torch.tensor([i in grads for i in self.ids])]] = True
        judged = seen & torch.isfinite(norm)  # the nonfinite rule reports the others
        absolute = self._absolute(norm, judged, out)
        relative = judged & ~absolute
        based = ~torch.isnan(self._log_base)
        if self._any_gone:  # back: warms up afresh from this step
            self._revive(judged & self._gone & (norm > DEAD))
        self._restart(seen & ~judged & ~based)  # a warm-up that went non-finite says nothing
        self._warm_up(norm, relative & ~based & ~self._gone)
        self._relative(norm, relative & based, out)
        return Judgement(out, seen.tolist())

    def _norms(
        self, grads: dict[int, float], vectors: Sequence[tuple[Sequence[int], Any]]
    ) -> tuple[Any, bool]:
        """The norm of each of the rule's parameters (0 without a gradient), and whether
        every one had a gradient. One device's vector is indexed as it is: its list of
        parameter indices is the plan's own, the same object step after step."""
        import torch

        if len(vectors) == 1:
            keys, vector = vectors[0]
            if keys is not self._keys:
                where = self.where(keys)
                self._keys = keys
                self._order = None if None in where else torch.tensor(where, dtype=torch.long)
            if self._order is not None:
                return vector[self._order].double(), True
        norms = torch.tensor([grads.get(i, 0.0) for i in self.ids], dtype=torch.float64)
        return norms, len(grads) >= len(self.ids) and all(i in grads for i in self.ids)

    def where(self, keys: Sequence[int]) -> list[int | None]:
        """Where each of the rule's parameters is in a norm vector of these parameter
        indices (None: not in it, no gradient this step)."""
        position = {key: j for j, key in enumerate(keys)}
        return [position.get(i) for i in self.ids]

    def bounds(self) -> tuple[Any, Any]:
        """Per group, the norms above and below which a step is out of range as the rule
        stands now (NaN: unbounded); what :meth:`judge` would say, as two vectors."""
        import torch

        self._to_tensor()
        rule, base = self.rule, self._log_base.exp()
        above, below = rule["explode_factor"] * base, rule["vanish_factor"] * base
        if rule["max_norm"] is not None:  # fmin/fmax: a group without a baseline has the limit
            above = torch.fmin(above, torch.full_like(above, rule["max_norm"]))
        if rule["min_norm"] is not None:
            below = torch.fmax(below, torch.full_like(below, rule["min_norm"]))
        return above, below

    def _quiet_floats(self, grads: dict[int, float]) -> bool:
        """:meth:`_quiet` for a few groups, in the host's floats: on a CPU a dozen tensor
        ops on a short vector cost more than the groups' arithmetic (the bench's CNN, 19
        groups: its judgement 250 -> 105 µs a step). Only once every group has a baseline,
        none is gone and no absolute limit is set; anything else goes to the vectors."""
        rule = self.rule
        if not self._few or self._unbased is not None or self._any_gone:
            return False
        if rule["max_norm"] is not None or rule["min_norm"] is not None:
            return False
        squares = [0.0] * len(self.names)
        for i, group in zip(self.ids, self._groups, strict=True):
            norm = grads.get(i)
            if norm is None:
                return False  # no gradient this step: judged group by group
            squares[group] += norm * norm
        bases = self._floats if self._floats is not None else self._log_base.tolist()
        high, low, logs = rule["explode_factor"], rule["vanish_factor"], []
        for square, base in zip(squares, bases, strict=True):
            norm, limit = math.sqrt(square), math.exp(base)
            if not (norm > 0 and low * limit <= norm <= high * limit):  # NaN: not calm
                return False
            logs.append(math.log(norm))
        self._floats = [b + self._alpha * (x - b) for b, x in zip(bases, logs, strict=True)]
        return True

    def log_base(self) -> Any:
        """Each group's log baseline now (NaN: none yet), as a vector."""
        self._to_tensor()
        return self._log_base

    def _to_tensor(self) -> None:
        """The float baselines back into ``_log_base``, for the vector ops."""
        if self._floats is not None:
            import torch

            self._log_base.copy_(torch.tensor(self._floats, dtype=torch.float64))
            self._floats = None

    def _quiet(self, norm: Any) -> bool:
        """The usual step, in a few ops: no absolute limit is set, every group with a
        baseline is positive and within its factors (so finite), and every group still
        warming up is finite. The baselines move, the others warm up; anything else is
        judged group by group."""
        import torch

        rule = self.rule
        if rule["max_norm"] is not None or rule["min_norm"] is not None:
            return False
        base = self._log_base.exp()
        calm = (norm > 0) & (norm <= rule["explode_factor"] * base)
        calm &= norm >= rule["vanish_factor"] * base
        if self._unbased is not None:
            calm |= self._unbased & torch.isfinite(norm)
        if self._any_gone:
            calm |= self._gone & (norm <= DEAD)
        if not bool(calm.all()):
            return False
        self._log_base.lerp_(torch.log(norm), self._alpha)  # a NaN (no baseline) stays NaN
        if self._unbased is not None:
            self._warm_up(norm, self._unbased)
        return True

    def _absolute(self, norm: Any, judged: Any, out: dict[int, Verdict]) -> Any:
        """``max_norm`` and ``min_norm``: out of range whatever the baseline."""
        import torch

        rule, flagged = self.rule, torch.zeros_like(judged)
        for kind, limit, beyond, word in (
            (EXPLODING, rule["max_norm"], norm.gt, "above max_norm"),
            (VANISHING, rule["min_norm"], norm.lt, "below min_norm"),
        ):
            if limit is None:
                continue
            hit = judged & ~flagged & beyond(limit)
            for g in hit.nonzero().flatten().tolist():
                value = float(norm[g])
                summary = f"gradient norm of {self._label(g)} is {value:.4g}, {word} {limit:g}"
                out[g] = (kind, value, summary, _past(kind, value, limit))
            flagged |= hit
        return flagged

    def _warm_up(self, norm: Any, warming: Any) -> None:
        """The latest ``warmup_steps`` norms per group; their median, once positive, is
        the baseline."""
        import torch

        groups = warming.nonzero().flatten()
        if not len(groups):
            return
        rows = self._warmed[groups] % len(self._warm)
        self._warm[rows, groups] = norm[groups]
        self._warmed[groups] += 1
        full = groups[self._warmed[groups] % len(self._warm) == 0]  # a window's worth more
        if len(full):
            window = self._warm[:, full]
            median = torch.quantile(window, 0.5, dim=0)  # the mean of two middles
            calm = self._calm(window)
            alive = (median > DEAD) & calm
            self._log_base[full[alive]] = median[alive].log()
            self._gone[full[(median <= DEAD) & calm]] = True
            self._changed()
            self._say_exploding(full[~calm], window[:, ~calm])

    def _revive(self, groups: Any) -> None:
        if bool(groups.any()):
            self._gone[groups] = False
            self._restart(groups)
            self._changed()

    def _changed(self) -> None:
        """Which groups warm up, and whether any is gone, after either changed."""
        unbased = self._log_base.isnan() & ~self._gone
        self._unbased = unbased if bool(unbased.any()) else None
        self._any_gone = bool(self._gone.any())

    def _restart(self, groups: Any) -> None:
        """Groups whose norm went non-finite before they had a baseline warm up afresh."""
        if bool(groups.any()):
            self._warm[:, groups] = math.nan
            self._warmed[groups] = 0

    def _calm(self, window: Any) -> Any:
        """Per group: did the warm-up's positive norms stay within ``explode_factor`` of each
        other? One already exploding (lr too high from the start) would make a baseline
        orders of magnitude too high, and every later step look like "vanishing"."""
        import torch

        positive = window > 0
        high = torch.where(positive, window, 0.0).amax(dim=0)
        low = torch.where(positive, window, math.inf).amin(dim=0)
        return ~positive.any(dim=0) | (high <= self.rule["explode_factor"] * low)

    def _say_exploding(self, groups: Any, window: Any) -> None:
        """Once per rule: a warm-up was refused, so there is no baseline yet."""
        if self._said or not len(groups):
            return
        self._said = True
        positive = window[window > 0]
        names = [self.names[g] for g in groups.tolist()]
        shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        announce(
            f"grad_norm rule {self.rule.name!r}: no baseline yet for {shown}: the gradient norms "
            f"of the warm-up already explode ({float(positive.min()):.3g} to "
            f"{float(positive.max()):.3g} over {len(self._warm)} steps, more than explode_factor "
            f"{self.rule['explode_factor']:g} apart); a baseline is taken once "
            f"{len(self._warm)} steps in a row stay within it (max_norm/min_norm judge meanwhile)"
        )

    def _relative(self, norm: Any, judged: Any, out: dict[int, Verdict]) -> None:
        """Against the baseline: out of range, or a healthy step that moves it."""
        import torch

        rule, base = self.rule, self._log_base.exp()
        exploding = judged & (norm > rule["explode_factor"] * base)
        vanishing = judged & ~exploding & (norm < rule["vanish_factor"] * base)
        healthy = judged & ~exploding & ~vanishing & (norm > 0)
        if bool(healthy.all()):  # the usual step: every group moves its baseline, none says
            self._log_base.lerp_(torch.log(norm), self._alpha)
            return
        for kind, hit, factor in (
            (EXPLODING, exploding, "explode_factor"),
            (VANISHING, vanishing, "vanish_factor"),
        ):
            for g in hit.nonzero().flatten().tolist():
                value, was = float(norm[g]), float(base[g])
                summary = (
                    f"gradient norm of {self._label(g)} is {value:.4g}, {value / was:.3g}x its "
                    f"baseline {was:.4g} ({factor} {rule[factor]:g})"
                )
                out[g] = (kind, value, summary, _past(kind, value, rule[factor] * was))
        moved = self._log_base[healthy]
        self._log_base[healthy] = moved + self._alpha * (torch.log(norm[healthy]) - moved)

    def _label(self, group: int) -> str:
        name = self.names[group]
        return name if name != "<total>" else "all parameters"


def _past(kind: str, norm: float, limit: float) -> float:
    """How many times past its limit a norm is (a zero norm, below any: infinitely)."""
    if kind == EXPLODING:
        return norm / limit
    return limit / norm if norm > 0 else math.inf
