"""The rank board: the ranks of one job see each other through the job's own store.

Every rank's watchdog thread publishes a small JSON status record under
``breakpod/<run id>/<restart>/rank/<N>`` in torchrun's rendezvous store
(``MASTER_ADDR:MASTER_PORT``, a TCPStore every rank can reach); no broker is
needed. A counter ``.../stalled`` says how many ranks are stalled now, so rank
0 reads one key per tick and the whole board only when a rank is stalled.

A record: ``rank, step, entered, completed, op, state, frame, stalled, time``
and, while stalled, ``stacks``. States: ``collective`` (inside collective #N),
``user`` (in user code), ``parked`` (held by a debugger), ``waiting-for-peer``
(paused because another rank is parked).

Pauses (``_job/pause.py``) use the same prefix: a counter ``.../parked`` (how many
ranks a debugger holds now), ``.../park/<N>`` (where and why rank N parked) and
``.../break`` (a job-wide break: the step every rank parks at, and whether it is
over).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from breakpod import protocol

CONNECT_SECONDS = 5.0
STATES = ("collective", "user", protocol.PARKED, "waiting-for-peer")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this process sits in its job, from the launcher's environment."""

    rank: int
    world_size: int
    host: str | None
    port: int | None
    run_id: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Place:
        env = os.environ if env is None else env
        port = env.get("MASTER_PORT", "")
        run = (
            f"{env.get('TORCHELASTIC_RUN_ID', 'job')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        return cls(
            rank=_int(env.get("RANK"), 0),
            world_size=_int(env.get("WORLD_SIZE"), 1),
            host=env.get("MASTER_ADDR") or None,
            port=int(port) if port.isdigit() else None,
            run_id=run,
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class Board:
    """One rank's connection to the job's store (used from the watchdog thread only)."""

    def __init__(self, store: Any, place: Place) -> None:
        self.store = store
        self.place = place
        self.prefix = f"breakpod/{place.run_id}"

    def publish(self, record: Mapping[str, Any]) -> None:
        self.store.set(f"{self.prefix}/rank/{self.place.rank}", json.dumps(record))

    def count_stalled(self, change: int = 0) -> int:
        return int(self.store.add(f"{self.prefix}/stalled", change))

    def count_parked(self, change: int = 0) -> int:
        return int(self.store.add(f"{self.prefix}/parked", change))

    def put(self, name: str, doc: Mapping[str, Any]) -> None:
        self.store.set(f"{self.prefix}/{name}", json.dumps(doc))

    def get(self, name: str) -> dict[str, Any] | None:
        key = f"{self.prefix}/{name}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def replace(
        self, name: str, seen: Mapping[str, Any] | None, doc: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Write ``doc`` unless another rank changed ``name`` since ``seen``; the value now."""
        expected = json.dumps(seen) if seen is not None else ""
        now = self.store.compare_set(f"{self.prefix}/{name}", expected, json.dumps(doc))
        return dict(json.loads(now))

    def read(self) -> dict[int, dict[str, Any]]:
        """Every rank's last record; ranks that never published are absent."""
        found: dict[int, dict[str, Any]] = {}
        for rank in range(self.place.world_size):
            key = f"{self.prefix}/rank/{rank}"
            if self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
        return found


def connect(place: Place) -> tuple[Board | None, str | None]:
    """A board, or ``None`` and why the job view is missing."""
    if place.host is None or place.port is None:
        return None, "MASTER_ADDR/MASTER_PORT are not set (not launched by torchrun?)"
    if "torch" not in sys.modules:
        return None, "torch is not imported in this process"
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        store = TCPStore(
            place.host,
            place.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=CONNECT_SECONDS),
            wait_for_workers=False,
        )
    except Exception as e:  # refused, timed out, a torch without TCPStore
        reason = (
            f"cannot reach the job store at {place.host}:{place.port} ({type(e).__name__}: {e})"
        )
        return None, reason.splitlines()[0][:300]
    return Board(store, place), None


def _int(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default
