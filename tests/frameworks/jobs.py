"""Framework jobs as real child processes: one Python process, or ranks under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from tests.distributed import torchrun
from tests.distributed.torchrun import TORCHRUN, Job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script(name: str) -> str:
    """The source of tests/frameworks/scripts/NAME.py, for the spawn fixture."""
    with open(os.path.join(ROOT, "tests", "frameworks", "scripts", f"{name}.py")) as f:
        return f.read()


def free_ports(count: int) -> int:
    """Ports apart from the distributed suite's, so the two folders never race for one."""
    return torchrun.free_ports(count, start=48400)


class Torchrun(Job):
    """tests/frameworks/scripts/NAME.py under torchrun (gloo, 127.0.0.1, its own port)."""

    def __init__(self, tmp_path: Path, name: str, nproc: int, **env: str) -> None:
        port = free_port()
        self.stderr_path = tmp_path / f"{name}-{port}.err"
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("BREAKPOD_") and k != "ENABLE_REMOTE_DEBUG"
        }
        clean.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        clean.update(HF_HUB_OFFLINE="1", **env)
        script = os.path.join(ROOT, "tests", "frameworks", "scripts", f"{name}.py")
        cmd = [str(TORCHRUN), f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1"]
        cmd += [f"--master-port={port}", f"--rdzv-id=job-{port}", script]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                env=clean,
                cwd=str(tmp_path),
                start_new_session=True,  # torchrun and its ranks: one group to kill
            )
