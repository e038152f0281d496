"""``breakpod run -- python script.py``: real child processes, signals and sockets."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CLI = "import sys\nfrom breakpod._cli.main import main\nraise SystemExit(main(sys.argv[1:]))\n"

CRASH = """
    def load(batch):
        size = len(batch)
        return batch[size]

    print("training", flush=True)
    load([1, 2, 3])
"""

CLEAN = """
    import sys
    print("step 1 loss 0.5")
    print("a warning", file=sys.stderr)
    sys.exit(4)
"""


@pytest.fixture
def breakpod_run(spawn, tmp_path: Path):
    """breakpod_run(source, *options) -> Child running ``breakpod run [options] -- python s.py``."""

    def _run(source: str, *options: str, env: dict[str, str] | None = None):
        script = tmp_path / "job.py"
        script.write_text(textwrap.dedent(source))
        args = ["run", *options, "--", sys.executable, str(script)]
        return spawn(CLI, args=args, env=env, stdin="closed", breakpod=False)

    return _run


def test_uncaught_exception_is_attachable_and_the_status_is_the_scripts(breakpod_run, pdb_client):
    child = breakpod_run(CRASH, "--hold", "30")
    client = pdb_client(child.park_port())
    banner = client.read_until()
    assert "uncaught IndexError" in banner and "return batch[size]" in banner
    assert client.command("p size, batch").strip() == "(3, [1, 2, 3])"
    client.send("c")
    client.read_all()
    assert child.wait() == 1
    assert "training" in child.stdout()
    assert "IndexError: list index out of range" in child.stderr


def test_nobody_attaching_exits_with_the_scripts_status_after_the_hold(breakpod_run):
    child = breakpod_run(CRASH, "--hold", "0.5")
    assert child.wait() == 1
    assert "nobody attached within 0.5s" in child.stderr


def test_clean_script_gets_no_extra_output_and_keeps_its_status(breakpod_run, spawn):
    wrapped = breakpod_run(CLEAN)
    plain = spawn(CLEAN, stdin="closed", breakpod=False)
    assert wrapped.wait() == plain.wait() == 4
    assert wrapped.stdout() == plain.stdout() == "step 1 loss 0.5\n"
    assert wrapped.stderr == plain.stderr == "a warning\n"


def test_the_child_gets_breakpods_switches(breakpod_run):
    show = """
        import os
        names = ["PYTHONBREAKPOINT", "BREAKPOD_POST_MORTEM", "ENABLE_REMOTE_DEBUG",
                 "TORCH_COMPILE_DISABLE", "BREAKPOD_HOLD_SECONDS", "BREAKPOD_BROKER_URL"]
        print(" ".join(os.environ.get(n, "-") for n in names))
    """
    child = breakpod_run(show, "--hold", "7", "--broker", "http://127.0.0.1:9")
    assert child.wait() == 0
    assert child.stdout().split() == [
        "breakpod.set_trace",
        "1",
        "1",
        "1",
        "7",
        "http://127.0.0.1:9",
    ]


def test_breakpoint_in_the_child_parks(breakpod_run, pdb_client):
    child = breakpod_run("x = 41\nbreakpoint()\nprint('done', x + 1)\n", "--hold", "30")
    client = pdb_client(child.park_port())
    client.read_until()
    assert client.command("p x").strip() == "41"
    client.send("c")
    assert child.wait() == 0
    assert child.stdout() == "done 42\n"


# A signal that lands between Python's last check for signals and the start of a long
# time.sleep() is seen only when that sleep ends: the children sleep in short steps.
SLEEPS = "for _ in range(300):\n    time.sleep(0.1)\n"


def test_signals_are_forwarded_to_the_child(breakpod_run):
    trap = """
        import signal, sys, time
        def stop(signum, frame):
            print("got", signum, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        for _ in range(300):  # short sleeps (see SLEEPS)
            time.sleep(0.1)
    """
    child = breakpod_run(trap)
    assert child.proc.stdout.readline() == b"ready\n"
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == 7
    assert child.stdout() == f"got {int(signal.SIGTERM)}\n"


def test_a_signal_that_kills_the_child_gives_128_plus_n(breakpod_run):
    child = breakpod_run(f"import time\nprint('ready', flush=True)\n{SLEEPS}")
    assert child.proc.stdout.readline() == b"ready\n"
    child.proc.send_signal(signal.SIGINT)
    assert child.wait() == 130  # KeyboardInterrupt: Python re-raises SIGINT at exit
    assert "KeyboardInterrupt" in child.stderr
    assert "waiting" not in child.stderr  # no post-mortem for Ctrl-C


def test_missing_program_and_bad_options_are_clear_errors():
    def breakpod(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "breakpod._cli.main", *args]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )

    missing = breakpod("run", "--", "no-such-program-xyz")
    assert missing.returncode == 127
    assert "cannot run 'no-such-program-xyz'" in missing.stderr
    bad = breakpod("run", "--hold", "soon", "--", "true")
    assert bad.returncode == 2 and "--hold='soon' is not a number of seconds" in bad.stderr
    empty = breakpod("run")
    assert empty.returncode == 2 and "nothing to run" in empty.stderr


def test_terminal_ctrl_c_reaches_the_child_once(tmp_path):
    """The tty sends SIGINT to the whole foreground group; breakpod must not add a second."""
    import os
    import pty

    script = tmp_path / "count.py"
    script.write_text(
        "import signal, time\n"
        "hits = []\n"
        "signal.signal(signal.SIGINT, lambda *_: hits.append(1))\n"
        "print('ready', flush=True)\n"
        "time.sleep(1)\n"
        "print('sigints', len(hits), flush=True)\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session whose controlling terminal is the pty
        os.execv(
            sys.executable, [sys.executable, "-c", CLI, "run", "--", sys.executable, str(script)]
        )
    output = b""
    try:
        while b"ready" not in output:
            output += os.read(fd, 1024)
        os.write(fd, b"\x03")  # Ctrl-C typed at the terminal
        while b"sigints" not in output or not output.endswith(b"\n"):
            output += os.read(fd, 1024)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert b"sigints 1" in output
    assert os.waitstatus_to_exitcode(status) == 0
