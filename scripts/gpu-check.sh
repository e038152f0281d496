#!/usr/bin/env bash
# The checks that need a CUDA device, as one short script for a machine that
# has one (a GPU box, or the device machine some sessions are lent): the
# `gpu`-marked tests, among them a monitored training step and a fused
# optimizer's skips decided on the device (FSDP2's too, its norms all-reduced
# over NCCL), each under
# torch.cuda.set_sync_debug_mode("error"), which fails on any host-device
# sync in breakpod's hooks, then the monitors bench on CUDA (bench/monitors.py
# --cuda: step-time ratios, and zero host syncs per monitored step under
# sync-debug "error" with the detailed tier's log/event rules), then the sentinel
# tier's host syncs per step (bench/sentinel.py --cuda: at most one a step at
# check_every=1, none between reads at check_every=10). Without a CUDA
# device it says so and exits 0. It uses that machine's own python3 with its torch
# and pytest; breakpod itself needs nothing installed (the agent has no
# dependencies), and the broker's test fixtures are left out (--noconftest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD/agent/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" - <<'PYCODE'
import torch
if not torch.cuda.is_available():
    raise SystemExit(1)
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu-check: torch {torch.__version__}, {len(names)} device(s): {', '.join(names)}")
PYCODE
then
  echo "gpu-check: skipped, no CUDA device visible here"
  exit 0
fi
GPU_TESTS=(tests/agent/test_monitor_cost.py tests/agent/test_monitor_sentinel.py
  tests/agent/test_monitor_staging.py tests/agent/test_monitor_gate.py
  tests/distributed/test_sharded_gpu.py)
"$PY" -m pytest "${GPU_TESTS[@]}" -m gpu --noconftest -p no:cacheprovider \
  -o addopts="" -o filterwarnings=ignore::DeprecationWarning --timeout 300 -v -rs
"$PY" bench/monitors.py --cuda
"$PY" bench/sentinel.py --cuda
