#!/usr/bin/env bash
# The checks that need a CUDA device, as one short script for a machine that
# has one (a GPU box, or the device machine some sessions are lent): the
# `gpu`-marked tests, among them a monitored training step under
# torch.cuda.set_sync_debug_mode("error"), which fails on any host-device
# sync in breakpod's hooks. It uses that machine's own python3 with its torch
# and pytest; breakpod itself needs nothing installed (the agent has no
# dependencies), and the broker's test fixtures are left out (--noconftest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD/agent/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'PYCODE'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu-check: no CUDA device visible; nothing to check here")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu-check: torch {torch.__version__}, {len(names)} device(s): {', '.join(names)}")
PYCODE
"$PY" -m pytest tests/agent/test_monitor_cost.py -m gpu --noconftest -p no:cacheprovider \
  -o addopts="" -o filterwarnings=ignore::DeprecationWarning --timeout 300 -v -rs
