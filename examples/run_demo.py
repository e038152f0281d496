"""`make demo`: run the NaN training job headless and show how breakpod parks it.

Without DEMO_AUTOATTACH the job waits for you: attach from another terminal
with the command it prints. With DEMO_AUTOATTACH=1 a scripted client attaches,
prints `loss` and the input's shape, and continues, so the demo runs unattended.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).parent
PARK = re.compile(r"waiting .* on (\S+):(\d+)")
SCRIPT = ["p loss", "p x.shape", "p torch.isnan(x).nonzero().tolist()", "c"]


def main() -> int:
    env = {**os.environ, "PYTHONBREAKPOINT": "breakpod.set_trace", "PYTHONUNBUFFERED": "1"}
    env.setdefault("BREAKPOD_PORT", "0")
    job = subprocess.Popen(
        [sys.executable, str(HERE / "train_nan.py")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    assert job.stdout is not None
    auto = os.environ.get("DEMO_AUTOATTACH") == "1"
    print(f"[demo] training job pid {job.pid}, stdin=/dev/null (headless)")
    for line in job.stdout:
        print(f"[job] {line}", end="", flush=True)
        match = PARK.search(line)
        if match and auto:
            host, port = match.group(1), int(match.group(2))
            threading.Thread(target=scripted_client, args=(host, port), daemon=True).start()
        elif match:
            print(
                f"[demo] attach from another terminal: .venv/bin/breakpod attach {address(match)}"
            )
    status = job.wait()
    print(f"[demo] training job exited with status {status}")
    return status


def address(match: re.Match[str]) -> str:
    return f"{match.group(1)}:{match.group(2)}"


def scripted_client(host: str, port: int) -> None:
    """What an engineer would type, sent over a plain socket (like nc)."""
    with socket.create_connection((host, port), timeout=30) as sock:
        reader = sock.makefile("r", encoding="utf-8", errors="replace", newline="")
        print("[demo] scripted client attached", flush=True)
        for command in SCRIPT:
            show(read_prompt(reader))
            print(f"[client] (Pdb) {command}", flush=True)
            sock.sendall(f"{command}\n".encode())
        show(reader.read())


def read_prompt(reader: object) -> str:
    text = ""
    while not text.endswith("(Pdb) "):
        char = reader.read(1)  # type: ignore[attr-defined]
        if not char:
            break
        text += char
    return text.removesuffix("(Pdb) ")


def show(text: str) -> None:
    for line in text.splitlines():
        print(f"[client] {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
