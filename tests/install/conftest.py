"""A fresh venv built by the README's own install lines: in the ``sh`` block of its
Install section, the lines from ``pip wheel`` to the block's end, read from README.md
at test time (so they cannot drift from what users copy) and run by bash in a folder
whose ``agent`` and ``broker`` are this checkout's, with the venv's ``pip`` first on
PATH. No torch: the agent and the broker never need it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_wheel_lines(readme: Path = ROOT / "README.md") -> str:
    """The Install section's lines that build and install the wheels: from ``pip
    wheel`` to the end of its ``sh`` block."""
    text = readme.read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in SH_BLOCK.findall(section) if "\npip wheel" in f"\n{b}"]
    assert len(blocks) == 1, f"README.md's Install section: {len(blocks)} pip wheel blocks"
    return "pip wheel" + f"\n{blocks[0]}".split("\npip wheel", 1)[1]


def run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        **kwargs,  # type: ignore[call-overload]
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """This environment less breakpod's and Python's settings, plus ``extra``."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("BREAKPOD_", "PYTHON"))}
    return {**keep, "HOME": str(Path(os.environ.get("TMPDIR", "/tmp"))), **extra}


@pytest.fixture(scope="session")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh venv the README's wheel lines installed into."""
    where = tmp_path_factory.mktemp("install")
    for name in ("agent", "broker"):
        (where / name).symlink_to(ROOT / name)
    run(sys.executable, "-m", "venv", where / "venv")
    bin_dir = where / "venv" / "bin"
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = clean_env(PATH=path, VIRTUAL_ENV=str(where / "venv"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    run("bash", "-euo", "pipefail", "-c", readme_wheel_lines(), cwd=where, env=env)
    return bin_dir
