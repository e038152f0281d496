"""The TensorBoard writer: a ``SummaryWriter`` you pass, or one made for a log folder.

A ``SummaryWriter`` (torch's or tensorboardX's) queues events and writes them
from its own thread, so a read costs the training thread a few appends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from breakpod._core.errors import ConfigError

INSTALL = "pip install 'breakpod[tensorboard]'"


class TensorBoardWriter:
    sep = "/"

    def __init__(self, writer: Any, *, owned: bool) -> None:
        self._writer = writer
        self._owned = owned  # made here: closed here; the caller's is only flushed

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._writer.add_text(tag, text, step)

    def close(self) -> None:
        self._writer.flush()
        if self._owned:
            self._writer.close()


def open_writer(writer_or_logdir: Any) -> TensorBoardWriter:
    """Wrap a writer, or make one for a folder; :class:`ConfigError` says what was wrong."""
    if hasattr(writer_or_logdir, "add_scalar"):
        return TensorBoardWriter(writer_or_logdir, owned=False)
    if not isinstance(writer_or_logdir, (str, os.PathLike)):
        raise ConfigError(
            f"expected a SummaryWriter or a log folder, got {type(writer_or_logdir).__name__}"
        )
    folder = Path(writer_or_logdir)
    _check_writable(folder)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(f"TensorBoard is not installed ({e}): {INSTALL}") from e
    return TensorBoardWriter(SummaryWriter(log_dir=str(folder)), owned=True)


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the log folder {folder} ({e.strerror})") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"the log folder {folder} is not writable; pass one that is")
