"""The sharded path on a GPU (FSDP2, NCCL, one rank): the norms' all-reduce and the
device-decided skip need no host sync between reads. Its own file, free of the CPU
tests' helpers (psutil), so that ``make gpu-check`` runs it with a bare torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(240)
def test_on_a_gpu_a_sharded_spike_is_dropped_with_no_sync_between_reads(tmp_path: Path) -> None:
    job = Path(__file__).with_name("fsdp_gpu_job.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1"]
    cmd += ["--master-addr=127.0.0.1", "--master-port=29561", str(job)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=200
    )
    assert done.returncode == 0, done.stdout + done.stderr
