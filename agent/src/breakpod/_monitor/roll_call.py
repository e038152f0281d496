"""Do all the ranks of some process groups watch the model? Asked before a monitor's
first collective (the sum of a sharded model's norms, a skip agreed with the peers): a
collective that one rank makes alone meets the others' next one instead (a hang, or
another's data). The ranks answer in the job's store, which needs no collective: a rank
that never answers costs the others a wait, not a hang."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from breakpod._core.announce import announce

ROLL_CALL_SECONDS = 10.0  # a first collective waits this long for every rank to watch
_ROLL_CALLS = itertools.count()  # the roll calls of this process, in order (as on every rank)


class RollCall:
    """Every one of some ranks answers in the job's store when its monitor plans
    (no collective: a rank that never answers costs the others a wait, not a hang)."""

    def __init__(self, ranks: Sequence[int], what: str) -> None:
        """``ranks``: the same list on each of them (a mesh's every rank, not the groups
        of one rank's: those overlap differently on each)."""
        dist = sys.modules["torch.distributed"]
        self.expected = len(ranks)
        self.what = what  # what the ranks do: "shard the model"
        first = min(ranks, default=0)
        self._key = f"breakpod/watching/{next(_ROLL_CALLS)}/{first}-{len(ranks)}"
        self._store: Any = None
        try:
            self._store = dist.distributed_c10d._get_default_store()
            self._store.add(self._key, 1)
        except Exception:  # no default store to answer in: no collective then
            self._store = None

    def answered(self, otherwise: str) -> bool:
        """Have all answered? Waits up to ``ROLL_CALL_SECONDS``, and if not, says so and
        what happens ``otherwise``."""
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        count = 0
        while self._store is not None:
            try:
                count = self._store.add(self._key, 0)
            except Exception:
                break
            if count >= self.expected:
                return True
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        announce(
            f"monitor: {count} of the {self.expected} ranks that {self.what} watch it "
            f"(after {ROLL_CALL_SECONDS:.0f} s): {otherwise} (call breakpod.watch() on "
            "every rank, for verdicts the ranks agree on)"
        )
        return False

    def closed(self, now: bool) -> bool:
        """Have all the ranks closed their monitor (``now``: this one closes now)? Told in
        the store too. Not if the store fails: a rank that stays makes its part, and one
        that went alone would leave the others waiting."""
        try:
            return bool(self._store.add(f"{self._key}/closed", int(now)) >= self.expected)
        except Exception:
            return False


class Collectives:
    """The process groups a monitor's collective runs over, one after another, once every
    rank of ``ranks`` answered the roll call (asked at the first use); none if not, and
    each rank does ``otherwise`` alone. Also where the collective's tensors live."""

    def __init__(self, groups: Sequence[Any], ranks: Sequence[int], what: str, otherwise: str):
        self._groups = list(groups)
        self._roll_call = RollCall(ranks, what)
        self._asked = False  # the roll call, at the first use
        self._otherwise = otherwise
        self.device: Any = None  # NCCL's: this rank's GPU; else the CPU
        if self._groups:
            import torch

            nccl = "nccl" in sys.modules["torch.distributed"].get_backend(self._groups[0])
            self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def groups(self) -> list[Any]:
        if not self._asked:
            self._asked = True
            if not self._roll_call.answered(self._otherwise):
                self._groups = []
        return self._groups

    @property
    def live(self) -> bool:
        """Do the ranks still make this collective (or will they ask the roll call)?"""
        return not self._asked or bool(self._groups)

    def disband(self) -> None:
        """No more of this collective, on this rank: each rank does ``otherwise`` alone."""
        self._asked, self._groups = True, []

    def leave(self, now: bool, wait: float = 0.0) -> bool:
        """This rank's monitor closes (``now``; or did before): have every rank's, within
        ``wait`` seconds? Told in the job's store: a rank may leave the collective once
        all do. Asked with this rank's collectives done: NCCL's run behind the host, and
        what the store says must come after them (a rank that read it ahead of its last
        collective could skip one that the others make)."""
        if self.device is not None:
            sys.modules["torch"].cuda.synchronize(self.device)
        deadline = time.monotonic() + wait
        left = self._roll_call.closed(now)
        while not left and time.monotonic() < deadline:
            time.sleep(0.01)
            left = self._roll_call.closed(False)
        return left
