"""`make bench`: every benchmark, each printing its side-by-side table.

Times on these machines are noisy; read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

BENCHMARKS = [
    *("pdb_latency", "sentinel", "sharded", "monitors", "zero_code", "health", "timetravel"),
    "stall",
    "stacks",
    *("broker", "scale"),
]


def main() -> int:
    for name in BENCHMARKS:
        if not (Path(__file__).parent / f"{name}.py").exists():
            continue
        print(f"\n=== bench/{name}.py ===", flush=True)
        started = time.monotonic()
        importlib.import_module(name).main()
        print(f"({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
