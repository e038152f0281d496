"""`make demo`: a headless training job hits a NaN; breakpod parks it, the
broker lists it, and an engineer attaches by session id.

1. a broker with its embedded Redis on a free 127.0.0.1 port (tokens made here);
2. examples/train_nan.py with stdin=/dev/null and PYTHONBREAKPOINT=breakpod.set_trace;
3. once it parks, `breakpod sessions` shows it;
4. `breakpod attach SESSION`: in a terminal, the demo attaches there and you
   type; without one (CI, an IDE runner, `| tee`), or with DEMO_AUTOATTACH=1,
   a scripted engineer prints `loss`, the input's shape and a tensor summary,
   then continues; the job finishes and exits 0. DEMO_AUTOATTACH=0 without a
   terminal prints the command for another terminal and counts down the hold.

Tokens reach the CLI through its environment, never as flags (they would show in
`ps`); the command printed for another terminal reads the viewer token from a file.
Whatever happens (an error, Ctrl-C, SIGTERM), the broker, its redis-server and the
job are stopped on the way out: the broker runs in a process group of its own,
killed once it has had its time. A demo killed outright (SIGKILL) takes the broker
with it too: the kernel sends it SIGTERM when the demo dies (PR_SET_PDEATHSIG), and
the broker stops its redis-server on the way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
PARK = re.compile(r"waiting .* for a debugger on (\S+):(\d+)")
SCRIPT = "p loss\np x.shape\ntstat x\ntnan model\nflight\nc\n"
TOKENS = {role: secrets.token_hex(8) for role in ("agent", "viewer", "admin")}


HOLD_SECONDS = float(os.environ.get("BREAKPOD_HOLD_SECONDS", "300"))
COUNTDOWN_EVERY = 30.0
BROKER_SHUTDOWN_SECONDS = 5  # the broker's own deadline (BREAKPOD_SHUTDOWN_SECONDS)
STOP_WAIT_SECONDS = 15.0  # then its process group is killed
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
CLI_ENV: dict[str, str] = {}


def main() -> int:
    auto = wants_scripted_engineer(os.environ.get("DEMO_AUTOATTACH"), sys.stdin.isatty())
    for sig in (signal.SIGTERM, signal.SIGHUP):  # end as Ctrl-C does: through the finally
        signal.signal(sig, _exit_on_signal)
    with tempfile.TemporaryDirectory(prefix="breakpod-demo-") as data:
        url = f"http://127.0.0.1:{free_port()}"
        # the CLI's settings, as an engineer exports them (a token is never a flag)
        CLI_ENV.update(BREAKPOD_BROKER_URL=url, BREAKPOD_BROKER_TOKEN=TOKENS["viewer"])
        broker = start_broker(url, data)
        try:
            wait_healthy(url)
            return run_job(url, auto, Path(data))
        finally:
            stop_group(broker)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_group(proc: subprocess.Popen[bytes], wait: float = STOP_WAIT_SECONDS) -> None:
    """SIGTERM, ``wait`` seconds, then SIGKILL to whatever is left of its group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            say(f"the broker did not stop within {wait:g}s: killing it and its redis-server")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its redis-server too, whatever became of it
    proc.wait()


def wants_scripted_engineer(setting: str | None, terminal: bool) -> bool:
    """1: always; 0: never; unset: when there is no terminal to type in."""
    if setting in ("0", "1"):
        return setting == "1"
    if not terminal:
        say("no terminal here: a scripted engineer attaches (DEMO_AUTOATTACH=0 to do it yourself)")
    return not terminal


def start_broker(url: str, data: str) -> subprocess.Popen[bytes]:
    port = url.rsplit(":", 1)[1]
    tokens = ",".join(f"{role}:{token}" for role, token in TOKENS.items())
    say(f"1/4 broker on {url} (embedded Redis, data in {data})")
    shutdown = str(BROKER_SHUTDOWN_SECONDS)
    broker = subprocess.Popen(
        [str(BIN / "breakpod-broker"), "serve", "--port", port, "--data-dir", data],
        env={**os.environ, "BREAKPOD_BROKER_TOKENS": tokens, "BREAKPOD_SHUTDOWN_SECONDS": shutdown},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, with its redis-server: see stop_group
        preexec_fn=_end_with_the_demo,  # the demo has no other thread yet
    )
    return broker


def _end_with_the_demo() -> None:
    """In the broker's process, before its program starts: SIGTERM when the demo dies,
    however it dies (a SIGKILL runs none of the demo's own cleanup)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_job(url: str, auto: bool, data: Path) -> int:
    env = {
        **os.environ,
        "PYTHONBREAKPOINT": "breakpod.set_trace",
        "PYTHONUNBUFFERED": "1",
        "BREAKPOD_BROKER_URL": url,
        "BREAKPOD_AGENT_TOKEN": TOKENS["agent"],
    }
    env.setdefault("BREAKPOD_PORT", "0")
    say("2/4 training job, headless (stdin=/dev/null), watched by breakpod.watch(model)")
    job = subprocess.Popen(
        [sys.executable, str(HERE / "train_nan.py")],
        env=env,
        text=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        relay = threading.Thread(target=relay_job, args=(job, auto, data), daemon=True)
        relay.start()
        status = wait_for(job)
        relay.join(timeout=5)  # the job's last lines
    finally:
        if job.poll() is None:  # the demo was interrupted: the job goes with it
            job.kill()
            job.wait()
    say(f"training job exited with status {status}; its events at the broker:")
    print(cli("events"), flush=True)
    return status


def relay_job(job: subprocess.Popen[str], auto: bool, data: Path) -> None:
    """The job's output, marked; the engineer starts once the job parks."""
    assert job.stdout is not None
    for line in job.stdout:
        print(f"[job] {line}", end="", flush=True)
        if PARK.search(line):
            threading.Thread(target=engineer, args=(auto, data), daemon=True).start()


def wait_for(job: subprocess.Popen[str]) -> int:
    """The job's status. The kernel hands a SIGTERM to any of the demo's threads, and
    Python runs the handler in the main thread at its next bytecode: the main thread
    waits in short sleeps (a wait with a timeout polls), never in one blocking call
    (reading a parked job's silent output, it hung until the hold ran out)."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return job.wait(timeout=1.0)


def engineer(auto: bool, data: Path) -> None:
    """What an engineer does once the job parks: find it, then attach."""
    session = parked_session()
    say("3/4 the broker knows the parked job:")
    print(cli("sessions"), flush=True)
    attach = ["attach", session]
    if not auto:
        if not sys.stdin.isatty():
            say(f"4/4 attach from another terminal: {other_terminal(session, data)}")
            count_down(session)
            return
        command = " ".join([str(BIN / "breakpod"), *attach])
        tries = "`p loss`, `tstat x`, `flight`, then `c`"
        say(f"4/4 attaching in this terminal ({command}); try {tries}")
        subprocess.run([str(BIN / "breakpod"), *attach], env={**os.environ, **CLI_ENV}, check=False)
        return
    say(f"4/4 scripted engineer: breakpod attach {session}")
    for line in cli(*attach, stdin=SCRIPT).splitlines():
        print(f"[engineer] {line}", flush=True)


def other_terminal(session: str, data: Path) -> str:
    """The command for another terminal: the token comes from a file (this user's only),
    through the environment, never as a flag."""
    token_file = data / "viewer.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(TOKENS["viewer"])
    url = CLI_ENV["BREAKPOD_BROKER_URL"]
    return (
        f"BREAKPOD_BROKER_URL={url} BREAKPOD_BROKER_TOKEN=$(cat {token_file}) "
        f"{BIN / 'breakpod'} attach {session}"
    )


def count_down(session: str) -> None:
    """One line every COUNTDOWN_EVERY seconds while the job waits for a debugger."""
    deadline = time.monotonic() + HOLD_SECONDS
    while still_parked(session) and (left := deadline - time.monotonic()) > 0:
        say(f"the job waits for a debugger on session {session}: {left:.0f}s left")
        time.sleep(min(COUNTDOWN_EVERY, max(left, 0.1)))


def still_parked(session: str) -> bool:
    listed = json.loads(cli("sessions", "--json"))
    return any(s["id"] == session and s.get("state") == "parked" for s in listed)


def parked_session(timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = json.loads(cli("sessions", "--json"))
        parked = [s["id"] for s in listed if s.get("state") == "parked"]
        if parked:
            return str(parked[0])
        time.sleep(0.2)
    raise TimeoutError("the job never showed up as parked at the broker")


def cli(*args: str, stdin: str = "") -> str:
    done = subprocess.run(
        [str(BIN / "breakpod"), *args],
        input=stdin,
        text=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, **CLI_ENV},
    )
    return done.stdout + done.stderr


def wait_healthy(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the broker at {url} did not become healthy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
