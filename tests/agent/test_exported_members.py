"""The public API is pinned, and importing breakpod stays cheap."""

from __future__ import annotations

import subprocess
import sys

import breakpod

EXPECTED = {
    "AttachError",
    "BreakpodError",
    "ConfigError",
    "Endpoint",
    "InsecureBindError",
    "ListenerError",
    "Settings",
    "__version__",
    "init_remote_debugger",
    "install_excepthook",
    "post_mortem",
    "set_trace",
    "heartbeat",
    "step",
    "watch_stalls",
    "watch",
    "Monitor",
    "Anomaly",
    "AnomalyError",
    "RuleError",
    "summary",
    "break_if_requested",
    "emit",
    "export",
    "health",
    "phase",
    "break_if",
}


def test_all_is_the_stable_api():
    assert set(breakpod.__all__) == EXPECTED
    for name in breakpod.__all__:
        getattr(breakpod, name)  # each lazy name resolves (AttributeError/ImportError if not)


def test_import_pulls_in_no_heavy_module():
    code = (
        "import sys, breakpod; "
        "heavy = {'torch', 'debugpy', 'numpy', 'pydevd', 'threading'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
