"""Device placement, data leakage and break_if: each fails on its broken case."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import breakpod
from breakpod.health import PlacementError, overlap, placement
from tests.agent.nets import Net


def test_placement_names_the_first_module_with_a_wrong_dtype() -> None:
    model = Net()
    with pytest.raises(RuntimeError) as plain:  # torch's own error names no module
        model(torch.randn(2, 8, dtype=torch.float64))
    assert "fc1" not in str(plain.value)
    check = placement(model, strict=True)
    with pytest.raises(PlacementError, match=r"module 'fc1' \(Linear\).*float32.*fix: "):
        model(torch.randn(2, 8, dtype=torch.float64))
    check.remove()


def test_by_default_placement_names_the_module_right_before_torchs_own_error(capfd) -> None:
    model = Net()
    placement(model)
    for _ in range(2):
        with pytest.raises(RuntimeError) as torch_error:
            model(torch.randn(2, 8, dtype=torch.float64))
        assert not isinstance(torch_error.value, PlacementError)
    said = [line for line in capfd.readouterr().err.splitlines() if "module 'fc1'" in line]
    assert len(said) == 1 and "float32" in said[0] and "fix: " in said[0], said  # once


def test_placement_names_a_module_on_another_device() -> None:
    model = Net()
    model.fc2.to("meta")
    check = placement(model, strict=True)
    with pytest.raises(PlacementError, match=r"module 'fc2'.*on meta but an input on cpu.*fix"):
        model(torch.randn(2, 8))
    check.remove()


class CastsItsInput(nn.Module):
    """As many HF modules do: ``x.to(self.weight.dtype)`` inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) @ self.weight * scale


def test_a_module_that_casts_its_own_input_runs_on_and_a_cpu_scalar_goes_anywhere(capfd):
    """Placement raised where torch runs fine: a module casting its input, so the check
    broke a job that worked. Now it says so once, and the call goes on."""
    module = CastsItsInput()
    placement(module)
    for _ in range(3):
        out = module(torch.randn(2, 4), torch.tensor(2.0))
    assert out.dtype == torch.float64
    said = [line for line in capfd.readouterr().err.splitlines() if "CastsItsInput" in line]
    assert len(said) == 1 and "float32" in said[0], said
    meta = nn.Linear(2, 2).to("meta")
    assert mismatch_of(meta, torch.tensor(1.0)) is None  # 0-dim on the CPU: a scalar
    assert mismatch_of(meta, torch.ones(1)) is not None


def mismatch_of(module: nn.Module, x: torch.Tensor) -> str | None:
    from breakpod.health._placement import mismatch

    return mismatch(next(module.parameters()), x)


def test_placement_lets_good_inputs_and_autocast_through() -> None:
    model = Net()
    check = placement(model)
    model(torch.randn(2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8))  # mixed dtypes are autocast's point
    model.fc1(torch.randn(2, 8))
    emb = nn.Embedding(10, 4)
    placement(emb)
    emb(torch.tensor([1, 2]))  # integer indices into float weights: fine
    check.remove()


def test_overlap_finds_the_leaked_samples() -> None:
    train = [(torch.full((3,), float(i)), i % 2) for i in range(100)]
    val = [(torch.full((3,), float(i)), 0) for i in (5, 200, 42, 300)]
    found = overlap(train, val)
    assert found.duplicates == 2 and found.examples == [(0, 5), (2, 42)]
    assert "2 of 4 validation samples" in str(found)
    clean = overlap(train, [(torch.full((3,), 1000.0), 0)])
    assert not clean and clean.duplicates == 0


def test_overlap_tells_equal_bytes_of_other_shapes_apart_and_takes_a_key() -> None:
    a, b = torch.zeros(4), torch.zeros(2, 2)
    assert not overlap([a], [b], key=lambda x: x)
    rows = [{"id": i, "text": f"t{i}"} for i in range(10)]
    assert overlap(rows, [{"id": 99, "text": "t3"}], key=lambda r: r["text"]).duplicates == 1


def test_overlap_streams_with_a_progress_line(capfd: pytest.CaptureFixture[str]) -> None:
    found = overlap(iter(range(1000)), iter(range(990, 1010)), progress=True)
    assert found.duplicates == 10 and found.train == 1000 and found.val == 20
    assert "breakpod overlap: train 1,000" in capfd.readouterr().err


BREAK_IF = """
    import torch, breakpod
    parks = 0
    for step in range(10):
        loss = torch.tensor(float('nan') if step == 1 else 1.0)
        parks += breakpod.break_if(~loss.isfinite(), every=4)
    print("parks", parks, flush=True)
"""


def test_break_if_parks_once_when_a_folded_tensor_condition_held(spawn) -> None:  # type: ignore[no-untyped-def]
    child = spawn(BREAK_IF, env={"BREAKPOD_HOLD_SECONDS": "0.5"})
    assert child.wait(timeout=60) == 0, child.stderr
    assert "parks 1" in child.stdout()  # step 1 held, folded, read at the 4th call
    assert re.search(r"break_if at .*child0\.py:6: the condition held", child.stderr)


def test_break_if_false_never_parks_and_bools_work() -> None:
    assert breakpod.break_if(torch.tensor(False), every=1) is False
    assert breakpod.break_if(False) is False
    assert breakpod.break_if(torch.tensor([0.0, 1.0]) > 5) is False
    loss = np.float32(1.0)  # a NumPy condition: it has .any() but is no tensor
    assert breakpod.break_if(np.isnan(loss) | (loss > 10)) is False
    assert breakpod.break_if(np.array([1.0, 2.0]) > 5) is False


NUMPY_BREAK = """
    import numpy as np, breakpod
    print("parked", breakpod.break_if(np.array([1.0, np.nan]) != np.array([1.0, np.nan])))
"""


def test_break_if_parks_on_a_numpy_condition_that_holds(spawn) -> None:  # type: ignore[no-untyped-def]
    child = spawn(NUMPY_BREAK, env={"BREAKPOD_HOLD_SECONDS": "0.5"})
    assert child.wait(timeout=60) == 0, child.stderr
    assert "parked True" in child.stdout() and "the condition held" in child.stderr


def test_overlap_compares_images_by_their_pixels() -> None:
    """A PIL image was hashed by its repr, which holds its address: ten validation images
    copied from the training set read as "0 of 10"."""
    image = pytest.importorskip("PIL.Image")
    train = [(image.new("RGB", (8, 8), (i, 0, 0)), i) for i in range(20)]
    val = [(img.copy(), label) for img, label in train[:10]]
    assert overlap(train, val).duplicates == 10
    assert overlap(train, [(image.new("L", (8, 8), 3), 0)]).duplicates == 0  # mode counts


def test_overlap_refuses_samples_it_could_only_compare_by_address() -> None:
    class Opaque:
        pass

    with pytest.raises(breakpod.ConfigError, match="key="):
        overlap([Opaque()], [Opaque()])
    with pytest.raises(breakpod.ConfigError, match="meta tensor"):
        overlap([torch.empty(2, device="meta")], [torch.zeros(2)])
    sparse = torch.eye(3).to_sparse()
    assert overlap([sparse], [torch.eye(3).to_sparse()]).duplicates == 1
