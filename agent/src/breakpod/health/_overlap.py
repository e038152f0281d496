"""Data leakage: samples of a validation split that also sit in the training split.

Streaming and hash-based: each training sample's key is hashed (16 bytes of
BLAKE2b) into a set, then the validation split is streamed against it, so
memory is ~100 bytes per training sample whatever the samples weigh. A key is
the sample's input by default (the first element of an ``(input, label)``
pair); ``key=`` picks another (a file name, a text field).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any

from breakpod._core.errors import ConfigError

PROGRESS_AT = 50_000  # samples: above this (or with progress=True) a progress line
EXAMPLES = 10


@dataclasses.dataclass
class Overlap:
    train: int
    val: int
    duplicates: int  # validation samples whose key is also in the training split
    examples: list[tuple[int, int]]  # (validation index, training index), the first few

    def __str__(self) -> str:
        share = 100 * self.duplicates / max(self.val, 1)
        pairs = ", ".join(f"val[{v}]=train[{t}]" for v, t in self.examples)
        head = f"{self.duplicates} of {self.val} validation samples ({share:.1f}%) are in train"
        return f"{head}: {pairs}" if pairs else head

    def __bool__(self) -> bool:
        return self.duplicates > 0


def overlap(
    train: Iterable[Any],
    val: Iterable[Any],
    key: Callable[[Any], Any] | None = None,
    *,
    progress: bool | None = None,
) -> Overlap:
    """Hash every sample of ``train``, then report the ``val`` samples found among them."""
    pick = key or default_key
    show = _wants_progress(progress, train, val)
    seen: dict[bytes, int] = {}
    n_train = 0
    for n_train, sample in enumerate(_progress(train, "train", show), 1):
        seen.setdefault(digest(pick(sample)), n_train - 1)
    found: list[tuple[int, int]] = []
    duplicates = n_val = 0
    for n_val, sample in enumerate(_progress(val, "val", show), 1):
        index = seen.get(digest(pick(sample)))
        if index is not None:
            duplicates += 1
            if len(found) < EXAMPLES:
                found.append((n_val - 1, index))
    return Overlap(n_train, n_val, duplicates, found)


def default_key(sample: Any) -> Any:
    """The input of an ``(input, label, …)`` sample, else the sample itself."""
    return sample[0] if isinstance(sample, (tuple, list)) and sample else sample


def digest(value: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.digest()


def _feed(h: Any, value: Any) -> None:
    """Content, not identity: tensors and arrays by dtype, shape and bytes."""
    if isinstance(value, bytes):
        h.update(value)
    elif isinstance(value, str):
        h.update(value.encode())
    elif _is_tensor(value):
        _feed_tensor(h, value)
    elif hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(value.tobytes())
    elif hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):
        h.update(f"image {value.mode} {value.size}".encode())  # a PIL image: its pixels
        h.update(value.tobytes())
    elif isinstance(value, (tuple, list)):
        for item in value:
            _feed(h, item)
            h.update(b"\x1f")
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
    else:
        text = repr(value)
        if _ADDRESS.search(text):  # identity, not content: copies would never match
            raise ConfigError(
                f"overlap: a {type(value).__name__} has no content to compare (its repr is "
                "its address): pass key= returning its content (bytes, an array, a tensor)"
            )
        h.update(text.encode())


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _feed_tensor(h: Any, value: Any) -> None:
    if value.is_meta:
        raise ConfigError("overlap: a meta tensor has no values to compare")
    array = value.detach().cpu()
    array = (array.to_dense() if array.layout != _strided() else array).contiguous()
    h.update(f"{array.dtype}{tuple(array.shape)}".encode())
    h.update(array.view(-1).view(_byte_dtype()).numpy().tobytes())


def _strided() -> Any:
    return sys.modules["torch"].strided


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor means torch is loaded: never import it here
    return torch is not None and isinstance(value, torch.Tensor)


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def _wants_progress(progress: bool | None, *splits: Any) -> bool:
    if progress is not None:
        return progress
    sizes = [len(s) for s in splits if isinstance(s, Sized)]
    return sum(sizes) >= PROGRESS_AT


def _progress(items: Iterable[Any], label: str, show: bool) -> Iterable[Any]:
    """A progress line on stderr, redrawn at most twice a second."""
    if not show:
        yield from items
        return
    total = len(items) if isinstance(items, Sized) else None
    last = 0.0
    n = 0
    for n, item in enumerate(items, 1):
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            _draw(label, n, total)
        yield item
    _draw(label, n, total, end="\n")


def _draw(label: str, n: int, total: int | None, end: str = "") -> None:
    stream = sys.__stderr__
    if stream is None:
        return
    of = f"/{total:,}" if total else ""
    stream.write(f"\rbreakpod overlap: {label} {n:,}{of}{end}")
    stream.flush()
