"""What each make target installs on first use, read from make's dry run (``make -n``)
into a venv that does not exist: ``make demo`` the runtime only (torch, the agent with
debugpy, the broker), ``make test`` and ``make lint`` the tools of requirements-dev.txt
besides, each install said in one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def dry_run(target: str, venv: Path) -> str:
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={venv}", target],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_demo_installs_the_runtime_only(tmp_path: Path) -> None:
    planned = dry_run("demo", tmp_path / "venv")
    assert "requirements-dev.txt" not in planned
    assert "torch==" in planned and "agent[debugpy]" in planned and "-e broker" in planned
    assert "installing the runtime" in planned


@pytest.mark.parametrize("target", ["test", "lint"])
def test_make_test_and_lint_install_the_tools_besides(tmp_path: Path, target: str) -> None:
    planned = dry_run(target, tmp_path / "venv")
    assert "installing the runtime" in planned
    assert "-r requirements-dev.txt" in planned and "installing the test and lint tools" in planned
