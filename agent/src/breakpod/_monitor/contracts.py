"""A monitor's shapes: each module's last input and output shapes (for ``tshape``),
and shape contracts (``expect=``) checked from metadata on the host, at once."""

from __future__ import annotations

import sys
from typing import Any

from breakpod._monitor import checks
from breakpod._monitor.anomaly import Anomaly
from breakpod._monitor.anomaly import user_frame as _user_frame
from breakpod._monitor.params import ParamPlanning
from breakpod._monitor.rules import Rule
from breakpod._monitor.state import Shapes


class ShapeContracts(ParamPlanning):
    """The shapes seen, and the contracts they are held to."""

    def _record_shapes(self, name: str, module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        """Remember the last input/output shapes; returns the output tensor (or None)."""
        out = checks.first_tensor(output)
        if out is not None:
            self.shapes[name] = _shapes(inputs, out)
        return out

    def _check_shape(self, name: str, rule: Rule, contract: checks.ShapeContract, out: Any) -> None:
        key = (rule.name, name)
        carried = self._shape_names.setdefault(key, {})  # names keep their size across steps
        shape = tuple(out.shape)
        why = contract.mismatch(shape) or contract.carried_mismatch(shape, carried)
        if why is None:
            carried.update(contract.names(shape))
            self._shape_active.discard(key)
            return
        if key in self._shape_active:
            return
        self._shape_active.add(key)
        summary = f"output shape {list(out.shape)} breaks the contract {contract.text}: {why}"
        details = {"expected": contract.text, "actual": list(out.shape)}
        value = float(out.dim())
        anomaly = Anomaly(rule.name, "shape", name, self.step_count, "forward", summary, value)
        anomaly.details, anomaly.tensor = details, out.detach()
        self._report([(anomaly, rule)], _user_frame(sys._getframe()))


def _shapes(inputs: tuple[Any, ...], out: Any) -> Shapes:
    """The input and output shapes, nested tensors' too (see :func:`.checks.shape_of`)."""
    import torch

    ins = [checks.shape_of(x) for x in inputs if isinstance(x, torch.Tensor)]
    return ins, checks.shape_of(out)
