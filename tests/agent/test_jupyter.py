"""``%load_ext breakpod`` in a real IPython kernel (jupyter_client + ipykernel)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ipykernel", reason="pip install -r requirements-dev.txt")
manager = pytest.importorskip("jupyter_client.manager")

pytestmark = pytest.mark.timeout(180)


class Cell:
    def __init__(self) -> None:
        self.stdout, self.stderr, self.html, self.error = "", "", [], None

    def hear(self, msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            setattr(self, content["name"], getattr(self, content["name"]) + content["text"])
        elif kind in ("display_data", "execute_result"):
            self.html.append(content["data"].get("text/html", ""))
        elif kind == "error":
            self.error = content["ename"]


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    env.update(BREAKPOD_HOLD_SECONDS="1", BREAKPOD_PORT="0", PYTHONPATH=os.getcwd())
    km, kc = manager.start_new_kernel(startup_timeout=120, env=env)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def run(kc: Any, code: str, stdin: list[str] | None = None) -> Cell:
    cell = Cell()
    answers = list(stdin or [])

    def answer(msg: dict[str, Any]) -> None:
        kc.input(answers.pop(0) if answers else "c")

    kc.execute_interactive(
        code, timeout=120, output_hook=cell.hear, allow_stdin=True, stdin_hook=answer
    )
    return cell


def test_load_ext_registers_the_magic_without_torch(kernel: Any) -> None:
    cell = run(kernel, "%load_ext breakpod\nimport sys; print('torch' in sys.modules)")
    assert cell.error is None and cell.stdout.strip() == "False", cell.stderr
    assert "usage: %breakpod" in run(kernel, "%breakpod nonsense").stderr
    for line in ("%breakpod", "%breakpod   "):  # nothing to unpack: the usage, no error
        cell = run(kernel, line)
        assert cell.error is None and "usage: %breakpod" in cell.stderr, cell.stderr
    bad = run(kernel, "%breakpod sessions --bogus")  # argparse's message, not SystemExit
    assert bad.error is None and "--bogus" in bad.stderr, bad.stderr


def test_importing_the_extension_takes_under_100_ms() -> None:
    code = (
        "import time; t = time.perf_counter(); import breakpod; "
        "import breakpod._integrations.jupyter; print(time.perf_counter() - t)"
    )
    best = min(
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
            ).stdout
        )
        for _ in range(3)
    )
    assert best < 0.1, f"{best * 1000:.0f} ms"


def test_watch_shows_anomalies_as_rich_output(kernel: Any) -> None:
    run(kernel, "%load_ext breakpod")
    setup = run(
        kernel,
        "import torch\nmodel = torch.nn.Linear(4, 2)\nmonitor = %breakpod watch model\n"
        "print(type(monitor).__name__)",
    )
    assert setup.stdout.strip() == "Monitor", setup.stderr
    cell = run(
        kernel,
        "model(torch.randn(2, 4)).sum().backward(); monitor.step(torch.tensor(float('nan')))",
    )
    shown = [h for h in cell.html if "breakpod-anomaly" in h]
    assert shown and "nonfinite" in shown[0], (cell.html, cell.stderr)
    run(kernel, "monitor.close()")


def test_debug_after_a_failed_cell_parks_post_mortem(kernel: Any) -> None:
    run(kernel, "%load_ext breakpod")
    assert run(kernel, "def f():\n    secret = 7\n    1 / 0\nf()").error == "ZeroDivisionError"
    cell = run(kernel, "%breakpod debug")
    assert "post-mortem" in cell.stderr and "nobody attached within 1" in cell.stderr, cell.stderr


def test_sessions_without_a_broker_says_what_to_set(kernel: Any) -> None:
    run(kernel, "%load_ext breakpod")
    assert "BREAKPOD_BROKER_URL" in run(kernel, "%breakpod sessions").stderr


PARKED = """
    x = 41
    breakpoint()
    print("finished", x + 1)
"""


def test_attach_runs_pdb_in_the_cell_with_kernel_input(kernel: Any, spawn: Any) -> None:
    child = spawn(PARKED, env={"BREAKPOD_HOLD_SECONDS": "60"})
    port = child.park_port(timeout=60)
    run(kernel, "%load_ext breakpod")
    cell = run(kernel, f"%breakpod attach 127.0.0.1:{port}", stdin=["p x * 2", "c"])
    assert "82" in cell.stdout, (cell.stdout, cell.stderr)
    assert child.wait(timeout=60) == 0 and "finished 42" in child.stdout()
