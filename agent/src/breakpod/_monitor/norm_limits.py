"""A ``grad_norm`` rule whose action is ``skip``, judged on the device for the update gate.

The host judges a step's gradient norms when it reads them (baselines.py): at
every step with ``check_every=1``, else every N steps, after the updates in
between. A rule that skips an update needs its verdict before that update, which
meant a read at every step (a device sync on a GPU). With a fused optimizer
(gate.py) the verdict need not reach the host: the rule's limits, as the host's
last judgement left them (``max_norm``/``min_norm``, and each baseline times
``explode_factor``/``vanish_factor``), are mirrored on the device, and each step's
group norms are compared with them there, a dozen small kernels, into the gate's
``found_inf``. As on the host, a group out of range is skipped once per outbreak,
at the step it leaves its range, not at every step it stays out (a lasting shift
would otherwise skip every update from then on).

The mirror is as fresh as the last read: the baselines do not move with the
steps between reads. A step the two judge differently is said at the read (gate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from breakpod._monitor.baselines import NormBaselines
from breakpod._monitor.rules import Rule

ON_DEVICE = ("log", "event", "skip")  # actions that need no host before the update


def judged_on_device(rule: Rule) -> bool:
    """Can the gate decide this rule's skips on the device? A ``grad_norm`` rule that
    skips, fires at once (``consecutive: 1``), and neither parks nor stops (those need
    the host before the update)."""
    actions = set(rule.actions)
    return (
        rule.check == "grad_norm"
        and "skip" in actions
        and actions <= set(ON_DEVICE)
        and rule.consecutive == 1
    )


class NormLimits:
    """One rule's limits on the device, and its groups out of range there."""

    def __init__(self, rule: Rule, baselines_of: Callable[[Rule], NormBaselines]) -> None:
        self.rule = rule
        self._baselines_of = baselines_of  # the host's, made on first use (detect.py)
        self._of: NormBaselines | None = None  # the baselines mirrored
        self._judged = -1  # their judgement the mirror holds
        self._device: Any = None
        self._keys: Sequence[int] | None = None
        self._order: Any = None  # where the rule's parameters are in the norm vector
        self._groups: Any = None  # the group of each parameter found in the vector
        self._seen: Any = None  # the groups with a parameter in it
        self._limits: Any = None  # (2, groups): above, below
        self._out: Any = None  # (2, groups): out of range at the last step judged here

    def leaves_range(self, keys: Any, vector: Any) -> Any:
        """A 0-d bool on the vector's device: does a group leave its range this step?
        None where no parameter of the rule has a gradient. A group without one keeps its
        state, as on the host."""
        import torch

        baselines = self._baselines_of(self.rule)
        if baselines is not self._of:  # the parameters were planned again (a lazy module)
            self._of, self._keys, self._judged, self._device = baselines, None, -1, None
        if not baselines.ids or not self._where(baselines, keys, vector.device):
            return None
        self._mirror(baselines, vector.device)
        norms = vector[self._order].double().square()
        norm = torch.zeros(len(baselines.names), dtype=torch.float64, device=vector.device)
        norm.index_add_(0, self._groups, norms).sqrt_()
        out = torch.stack((norm > self._limits[0], norm < self._limits[1]))
        out = torch.where(self._seen, out, self._out)
        leaves = (out & ~self._out).any()
        self._out.copy_(out)
        return leaves

    def _where(self, baselines: NormBaselines, keys: Sequence[int], device: Any) -> bool:
        """Where the rule's parameters are in this norm vector, their groups, and the groups
        seen; False if none is. The keys are the plan's own list, the same object step
        after step while every parameter has a gradient."""
        import torch

        if keys is self._keys and device == self._device:
            return self._order is not None
        where = baselines.where(keys)
        groups = baselines.group_of.tolist()
        found = [(j, g) for j, g in zip(where, groups, strict=True) if j is not None]
        self._keys = keys
        if not found:
            self._order = None
            return False
        self._order = _on(torch.tensor([j for j, _ in found]), device)
        self._groups = _on(torch.tensor([g for _, g in found]), device)
        self._seen = torch.zeros(len(baselines.names), dtype=torch.bool, device=device)
        self._seen[self._groups] = True
        return True

    def _mirror(self, baselines: NormBaselines, device: Any) -> None:
        """The host's limits on the device, once per host judgement."""
        import torch

        if baselines.judged == self._judged and device == self._device:
            return
        limits = torch.stack(baselines.bounds())
        self._limits = _on(limits, device)
        if device != self._device or self._out is None or self._out.shape != limits.shape:
            self._out = torch.zeros(limits.shape, dtype=torch.bool, device=device)
        self._judged, self._device = baselines.judged, device


def _on(host: Any, device: Any) -> Any:
    """A host tensor on ``device``: on a GPU a pinned, non-blocking copy (no sync; the
    caching host allocator keeps the pinned memory until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
