"""breakpoint() in a headless child parks on a socket instead of dying."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from breakpod._debug.listener import MAX_HANDSHAKES
from tests.conftest import PARK_LINE

SCRIPT = """
    x = 41
    breakpoint()
    x += 1
    print("finished", x)
"""


@pytest.mark.parametrize("stdin", ["devnull", "closed"])
def test_headless_breakpoint_parks_and_continues(spawn, pdb_client, stdin):
    child = spawn(SCRIPT, stdin=stdin)
    client = pdb_client(child.park_port())
    banner = client.read_until()
    assert "breakpod: attached to pid" in banner
    assert "-> x += 1" in banner  # the caller's frame, next line
    assert client.command("p x").strip() == "41"
    client.send("c")
    assert "continuing" in client.read_all()
    assert child.wait() == 0
    assert "finished 42" in child.stdout()


TORCH_SCRIPT = """
    import sys
    import torch
    x = torch.ones(2, 3)
    breakpoint()
    print("monitors loaded:", "breakpod._monitor.monitor" in sys.modules)
"""


def test_a_breakpoint_after_torch_has_the_tensor_commands_without_a_monitor(spawn, pdb_client):
    """The debugger's command registry gets the tensor commands from the package's face
    once torch is loaded (the debugger imported them by name: a hidden import circle)."""
    child = spawn(TORCH_SCRIPT)
    client = pdb_client(child.park_port(timeout=60))
    client.read_until()
    assert "tensor[2,3] f32 cpu" in client.command("tstat x")
    assert "tstat" in client.command("help")
    client.send("c")
    client.read_all()
    assert child.wait(timeout=30) == 0
    assert "monitors loaded: True" in child.stdout()  # they name the monitors they read


@pytest.mark.parametrize("stdin", ["devnull", "closed"])
def test_without_breakpod_the_same_script_dies(spawn, stdin):
    child = spawn(SCRIPT, stdin=stdin, breakpod=False)
    assert child.wait() != 0
    assert "finished" not in child.stdout()
    assert "BdbQuit" in child.stderr or "lost sys.stdin" in child.stderr


def test_client_disconnect_continues_the_program(spawn, pdb_client):
    child = spawn(SCRIPT)
    client = pdb_client(child.park_port())
    client.read_until()
    client.close()
    assert child.wait() == 0
    assert "finished 42" in child.stdout()


def test_on_detach_wait_hands_the_session_to_the_next_client(spawn, pdb_client):
    child = spawn(SCRIPT, env={"BREAKPOD_ON_DETACH": "wait"})
    port = child.park_port()
    first = pdb_client(port)
    first.read_until()
    first.command("x = 100")
    first.close()
    second = pdb_client(port)
    assert "-> x += 1" in second.read_until()
    assert second.command("p x").strip() == "100"
    second.send("c")
    assert child.wait() == 0
    assert "finished 101" in child.stdout()


def test_quit_detaches_and_continues(spawn, pdb_client):
    child = spawn(SCRIPT)
    client = pdb_client(child.park_port())
    client.read_until()
    client.send("q")
    assert "program continues" in client.read_all()
    assert child.wait() == 0
    assert "finished 42" in child.stdout()


def test_quit_exit_mode_stops_the_program(spawn, pdb_client):
    child = spawn(SCRIPT, env={"BREAKPOD_QUIT": "exit"})
    client = pdb_client(child.park_port())
    client.read_until()
    client.send("q")
    client.read_all()
    assert child.wait() != 0
    assert "BdbQuit" in child.stderr


def test_second_client_is_refused_with_one_line(spawn, pdb_client):
    child = spawn(SCRIPT)
    port = child.park_port()
    first = pdb_client(port)
    first.read_until()
    second = pdb_client(port)
    refusal = second.read_all()
    assert refusal.count("\n") == 1 and "already attached" in refusal
    assert first.command("p x").strip() == "41"  # the first session is unaffected
    first.send("c")
    assert child.wait() == 0


TOKEN_ENV = {"BREAKPOD_LISTENER_TOKEN": "s3cret-token", "BREAKPOD_REQUIRE_TOKEN": "1"}


def test_non_loopback_bind_without_token_is_refused(spawn):
    child = spawn(SCRIPT, env={"BREAKPOD_HOST": "0.0.0.0"})
    child.wait_for("refusing to bind .* without a token")
    assert child.wait() == 0  # the program was not killed; it continued
    assert "finished 42" in child.stdout()


@pytest.fixture
def tokened_child(spawn):
    """Token required as on a non-loopback bind, without leaving loopback."""
    child = spawn(SCRIPT, env=TOKEN_ENV)
    return child, "127.0.0.1", child.park_port()


def test_token_required_when_asked(tokened_child, pdb_client):
    child, host, port = tokened_child
    client = pdb_client(port, host)
    assert "token required" in client.read_until("\n")
    client.send("s3cret-token")
    assert "attached" in client.read_until()
    client.send("c")
    assert child.wait() == 0


def test_wrong_token_is_refused(tokened_child, pdb_client):
    child, host, port = tokened_child
    client = pdb_client(port, host)
    client.read_until("\n")
    client.send("guess")
    assert "wrong or missing token" in client.read_all()
    good = pdb_client(port, host)  # the process still waits for the right client
    good.read_until("\n")
    good.send("s3cret-token")
    good.read_until()
    good.send("c")
    assert child.wait() == 0


def test_a_silent_client_does_not_hold_up_the_next_one(tokened_child, pdb_client):
    child, host, port = tokened_child
    silent = pdb_client(port, host)
    assert "token required" in silent.read_until("\n")  # ... and never answers
    good = pdb_client(port, host)
    good.read_until("\n")
    good.send("s3cret-token")
    assert "attached" in good.read_until()  # within the client's 10 s timeout
    good.send("c")
    assert child.wait() == 0


def test_clients_holding_handshakes_a_byte_at_a_time_do_not_keep_the_engineer_out(
    tokened_child, pdb_client
):
    child, host, port = tokened_child
    squatters = []
    for _ in range(MAX_HANDSHAKES + 4):  # each sends a byte, never a line
        squatter = pdb_client(port, host)
        squatter.read_until("\n")
        squatter.sock.sendall(b"x")
        squatters.append(squatter)
    good = pdb_client(port, host)
    good.read_until("\n")
    good.send("s3cret-token")
    assert "attached" in good.read_until()
    good.send("c")
    assert child.wait() == 0


def test_require_token_without_a_token_is_a_clear_error(spawn):
    child = spawn(SCRIPT, env={"BREAKPOD_REQUIRE_TOKEN": "1"})
    child.wait_for(
        "BREAKPOD_REQUIRE_TOKEN=1 needs BREAKPOD_LISTENER_TOKEN to be set .*no debugger listener"
    )
    assert child.wait() == 0 and "finished 42" in child.stdout()  # continued, no listener


def test_nobody_attaching_continues_after_the_hold_time(spawn):
    child = spawn(SCRIPT, env={"BREAKPOD_HOLD_SECONDS": "0.5"})
    assert child.wait() == 0
    assert "nobody attached within 0.5s" in child.stderr
    assert "finished 42" in child.stdout()


LOOP = """
    import signal
    signal.signal(signal.SIGUSR1, lambda *_: breakpoint())  # a park nested in a park
    for i in range(2):
        breakpoint()
        y = i
    print("finished", flush=True)
"""


def test_after_continue_with_breakpoints_set_the_next_breakpoint_stops_for_the_same_client(
    spawn, pdb_client
):
    """The client stays attached for its breakpoints: the next breakpoint() is its,
    not a new park that waits for a client the listener would refuse."""
    child = spawn(LOOP, env={"BREAKPOD_HOLD_SECONDS": "30"})
    client = pdb_client(child.park_port())
    client.read_until()
    assert client.command("p i").strip() == "0"
    client.command("b 7")  # print("finished")
    stopped = client.command("c")  # on to the next breakpoint(): the same client's
    assert "breakpoint() at" in stopped and "-> y = i" in stopped
    assert client.command("p i").strip() == "1"
    assert 'print("finished"' in client.command("c")  # and then its breakpoint
    client.command("clear 1")
    client.send("c")
    assert child.wait() == 0 and "finished" in child.stdout()


def test_a_park_nested_in_a_signal_handler_gets_the_client(spawn, pdb_client):
    """The outer park waits in the same thread, under the handler: the inner one, the
    code that runs, must take the client."""
    child = spawn(LOOP, env={"BREAKPOD_HOLD_SECONDS": "30"})
    port = child.park_port()
    child.proc.send_signal(signal.SIGUSR1)
    child.wait_for("(?s)waiting up to 30s for a debugger.*waiting up to 30s for a debugger")
    client = pdb_client(port)
    assert "signal.signal" in client.read_until()  # the handler's frame: line 3
    client.send("c")  # the handler returns; the outer park waits again
    assert "detached" in client.read_all()
    outer = pdb_client(port)
    outer.read_until()
    outer.send("c")
    outer.read_all()
    second = pdb_client(port)  # the loop's second breakpoint()
    second.read_until()
    second.send("c")
    assert child.wait() == 0 and "finished" in child.stdout()


PREEMPTED = """
    import signal, sys
    from breakpod._core import events, holding
    seen = []
    events.add_sink(lambda event: seen.append((event.kind, event.fields.get("why"))))

    class Preempted(Exception):
        pass

    def on_term(signum, frame):  # the usual "save a checkpoint and stop"
        raise Preempted("SIGTERM")

    signal.signal(signal.SIGTERM, on_term)
    try:
        breakpoint()
        print("trained on", flush=True)
    except Preempted:
        print("stopped; held:", holding.is_held(), seen[-1], flush=True)
        sys.exit(143)
"""


def test_an_exception_a_signal_handler_raises_in_a_park_reaches_the_job(spawn):
    """The job's own exception is not breakpod's failure: it leaves the breakpoint()
    as it would any line, and the process is no longer held (the stall watchdog
    judges it again)."""
    child = spawn(PREEMPTED, env={"BREAKPOD_HOLD_SECONDS": "30"})
    child.park_port()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait() == 143
    assert "stopped; held: False ('resumed', 'interrupted by Preempted')" in child.stdout()
    assert "interrupted by Preempted while waiting for a debugger" in child.stderr
    assert "could not start a debugger" not in child.stderr


FORK = """
    import os, breakpod
    breakpod.init_remote_debugger(port=0, backend="pdb", enable=True)
    pid = os.fork()
    if pid == 0:  # a DataLoader-style forked worker
        worker = "child"
        breakpoint()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("worker exited", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_forked_worker_parks_on_its_own_listener(spawn, pdb_client):
    child = spawn(FORK)
    parent_port = int(child.wait_for(r"remote pdb ready on 127\.0\.0\.1:(\d+)").group(1))
    worker_port = child.park_port()
    assert worker_port != parent_port
    client = pdb_client(worker_port)
    client.read_until()
    assert client.command("p worker").strip() == "'child'"
    client.send("c")
    assert child.wait() == 0
    assert "worker exited 0" in child.stdout()


def test_with_a_tty_breakpoint_is_plain_local_pdb(tmp_path):
    proc, main = _spawn_on_a_tty(tmp_path, {})
    try:
        transcript = _pty_session(main, ["p x", "c"])
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        os.close(main)
    assert "(Pdb) " in transcript and "41" in transcript and "finished 42" in transcript
    assert "waiting" not in transcript  # no socket, no park


def test_with_a_tty_and_remote_debug_enabled_breakpoint_still_parks(tmp_path, pdb_client):
    proc, main = _spawn_on_a_tty(tmp_path, {"ENABLE_REMOTE_DEBUG": "1", "BREAKPOD_PORT": "0"})
    try:
        text = ""
        while not PARK_LINE.search(text):
            assert select.select([main], [], [], 10)[0], text
            text += os.read(main, 4096).decode(errors="replace")
        client = pdb_client(int(PARK_LINE.search(text).group(2)))
        client.read_until()
        assert client.command("p x").strip() == "41"
        client.send("c")
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        os.close(main)


def _spawn_on_a_tty(tmp_path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    script = tmp_path / "tty.py"
    script.write_text("x = 41\nbreakpoint()\nprint('finished', x + 1)\n")
    env = {**os.environ, "PYTHONBREAKPOINT": "breakpod.set_trace", "TERM": "dumb", **env}
    main, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        close_fds=True,
    )
    os.close(secondary)
    return proc, main


def _pty_session(fd: int, commands: list[str]) -> str:
    """Answer each (Pdb) prompt on the terminal with the next command."""
    out, pending = "", list(commands)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        try:
            chunk = os.read(fd, 4096).decode(errors="replace")
        except OSError:  # the child closed the terminal
            break
        out += chunk
        if out.rstrip().endswith("(Pdb)") and pending:
            os.write(fd, (pending.pop(0) + "\n").encode())
    return out


def test_wrong_tokens_delay_a_remote_guesser_longer_than_everyone_else():
    from breakpod._core.throttle import FORGET_AFTER, OVERALL_CAP, GuessThrottle

    throttle = GuessThrottle()
    assert throttle.wait("203.0.113.5", 100.0) == 0  # no failure yet: judged at once
    for _ in range(10):
        throttle.failed("203.0.113.5", 100.0)
    assert throttle.wait("203.0.113.5", 100.0) == pytest.approx(0.05 * 2**9)
    assert throttle.wait("198.51.100.7", 100.0) == pytest.approx(OVERALL_CAP)  # the overall cap
    throttle.failed("127.0.0.1", 100.0)  # loopback (port-forward) peers share the overall one
    assert throttle.wait("127.0.0.1", 100.0) == pytest.approx(OVERALL_CAP)
    assert throttle.wait("203.0.113.5", 101.0 + FORGET_AFTER) == 0  # quiet for a minute


def test_the_nc_hint_takes_an_ipv6_address_apart():
    from breakpod._debug.park import nc_args

    assert nc_args("[::1]:5678") == "::1 5678"  # was: "[  1] 5678"
    assert nc_args("127.0.0.1:5678") == "127.0.0.1 5678"


def _raised_through(module: str, filename: str) -> BaseException:
    """An exception raised in ``module`` (compiled as ``filename``) and caught, as the
    park's wait catches it, in a frame of breakpod's."""
    job: dict[str, object] = {"__name__": module}
    exec(compile("def handler():\n    raise RuntimeError('stop')\n", filename, "exec"), job)
    ours: dict[str, object] = {"__name__": "breakpod._debug.fake", "handler": job["handler"]}
    source = textwrap.dedent(
        """
        def wait():
            try:
                handler()
            except RuntimeError as e:
                return e
        """
    )
    exec(compile(source, "breakpod_fake.py", "exec"), ours)
    return ours["wait"]()  # type: ignore[operator, no-any-return]


def test_the_jobs_exception_is_told_apart_by_module_not_by_folder():
    """A job installed into site-packages lives under the standard library's folder
    (a venv, the official Python images): its SIGTERM handler's exception was taken
    for breakpod's own and swallowed."""
    import sysconfig

    from breakpod._debug.breakpoints import raised_elsewhere

    stdlib = sysconfig.get_paths()["stdlib"]
    installed = f"{stdlib}/site-packages/jobpkg/signals.py"
    assert raised_elsewhere(_raised_through("jobpkg.signals", installed))
    assert raised_elsewhere(_raised_through("__main__", "train.py"))
    assert not raised_elsewhere(_raised_through("json.decoder", f"{stdlib}/json/decoder.py"))
    assert not raised_elsewhere(_raised_through("breakpod._core.net", "net.py"))
