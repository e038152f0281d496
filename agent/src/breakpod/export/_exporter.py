"""An exporter: hears the event hub, writes through one backend writer.

The monitor publishes each read's per-step statistics on the hub's local topic
(:data:`breakpod._core.events.STEP_STATS`, never sent to the broker) and each
anomaly as an ``anomaly`` event; the exporter turns both into metric points
(:mod:`breakpod.export._points`) and hands them to a writer. It runs on the
training thread at reads only, never in a hook. A writer that fails is
reported once, and the exporter stops writing; training goes on.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from typing import Any, Protocol

from breakpod import protocol
from breakpod._core import events
from breakpod._core.announce import announce
from breakpod.export._points import MODEL, PREFIX, encode, step_metrics
from breakpod.health._phases import timers


class Writer(Protocol):
    """What a backend offers (TensorBoard, MLflow); ``sep`` joins name parts."""

    sep: str

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def text(self, step: int, tag: str, text: str) -> None: ...

    def close(self) -> None: ...


class Exporter:
    """Subscribed to the hub until :meth:`close`; ``enabled`` is False when setup failed."""

    def __init__(self, name: str, writer: Writer | None) -> None:
        self.name = name
        self.writer = writer
        self.points = 0  # metric points written
        self._skipped_seen: set[tuple[int, int]] = set()  # (id(monitor), step)
        self._phases_seen: dict[str, tuple[int, float, int, float]] = {}
        self._refused: set[str] = set()  # names log() left out (said once each)
        if writer is not None:
            events.add_local_sink(self._on_stats)
            events.add_sink(self._on_event)
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Write your own values with the same rules (a non-finite one becomes its flags);
        one that is not a number (None, a string, a tensor of many values) is left out,
        said once per name."""
        if self.writer is None:
            return
        encoded = encode(self._numbers(values), self.writer.sep)
        self._guard(lambda w: w.scalars(step, encoded))
        self.points += len(encoded)

    def close(self) -> None:
        """Unsubscribe and flush; idempotent."""
        events.remove_local_sink(self._on_stats)
        events.remove_sink(self._on_event)
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:
                announce(f"{self.name} exporter: closing failed ({type(e).__name__}: {e})")

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hub sinks ---------------------------------------------------------------------
    def _on_stats(self, event: events.Event) -> None:
        if event.kind != events.STEP_STATS:
            return
        monitor, params = event.fields["monitor"], event.fields["params"]
        for data in event.fields["steps"]:
            self.log(data.step, self._named(step_metrics(data, params)))
        if event.fields["read_done"]:  # timings since the last read, at its last step
            self._log_phases(event.fields["steps"][-1].step)
        self._log_skipped(monitor)

    def _on_event(self, event: events.Event) -> None:
        if event.kind != protocol.ANOMALY or self.writer is None:
            return
        fields = event.fields
        step = int(fields.get("step", 0))
        rule = str(fields.get("rule", "rule"))
        where = fields.get("module") or MODEL
        line = f"step {step} {fields.get('phase', '')} {where}: [{rule}] {fields.get('summary')}"
        self.log(step, self._named({f"{PREFIX}/anomaly/{rule}": 1.0}))
        self._guard(lambda w: w.text(step, f"{PREFIX}/anomalies", line))

    def _log_phases(self, step: int) -> None:
        """``breakpod.phase`` timings since the last read: mean host (and CUDA) ms per phase."""
        timers.resolve()
        now = {
            name: (s.count, s.host_s, s.device_count, s.device_ms)
            for name, s in timers.phases.items()
        }
        values = {}
        for name, (count, host_s, dev_count, dev_ms) in now.items():
            count0, host0, dev_count0, dev0 = self._phases_seen.get(name, (0, 0.0, 0, 0.0))
            if count > count0:
                values[f"{PREFIX}/phase/{name}/host_ms"] = (
                    1000 * (host_s - host0) / (count - count0)
                )
            if dev_count > dev_count0:
                values[f"{PREFIX}/phase/{name}/device_ms"] = (dev_ms - dev0) / (
                    dev_count - dev_count0
                )
        self._phases_seen = now
        if values:
            self.log(step, self._named(values))

    def _log_skipped(self, monitor: Any) -> None:
        """Steps whose update a ``skip`` rule dropped (known after the read that found them)."""
        if not getattr(monitor, "skipped_steps", 0):
            return
        for anomaly in reversed(monitor.anomalies[-64:]):
            key = (id(monitor), anomaly.step)
            if anomaly.skipped and key not in self._skipped_seen:
                self._skipped_seen.add(key)
                self.log(anomaly.step, self._named({f"{PREFIX}/skipped": 1.0}))

    def _numbers(self, values: Mapping[str, Any]) -> dict[str, float]:
        numbers = {}
        for name, value in values.items():
            try:
                if isinstance(value, str | bytes):  # "1.5" is text: say so, not guess
                    raise TypeError("text")
                numbers[name] = float(value)
            except (TypeError, ValueError, RuntimeError) as e:  # torch: "only one element"
                if name not in self._refused:
                    self._refused.add(name)
                    announce(
                        f"{self.name} exporter: {name!r} is {type(value).__name__} "
                        f"({e}), not a number: left out"
                    )
        return numbers

    def _named(self, values: Mapping[str, float]) -> dict[str, float]:
        sep = self.writer.sep if self.writer is not None else "/"
        return {name.replace("/", sep): v for name, v in values.items()}

    def _guard(self, write: Any) -> None:
        """A failing backend is reported once; the exporter then stops (training goes on)."""
        writer = self.writer
        if writer is None:
            return
        try:
            write(writer)
        except Exception as e:
            announce(
                f"{self.name} exporter: writing failed ({type(e).__name__}: {e}); "
                "export stops, training goes on"
            )
            self.close()
