"""Attacks on the remote pdb listener of a real training loop (stdin closed).

For each attack: the job finishes its loop, and the real engineer gets a
``(Pdb)`` prompt within 2 s while the attack goes on. ``CHAOS_ROUNDS`` parks
(default 2; ``make chaos`` sets 20) are attacked in one job.
"""

from __future__ import annotations

import contextlib
import os
import socket
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from breakpod._core.throttle import OVERALL_CAP
from tests.conftest import Child, PdbClient

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "2"))
TOKEN = "tok-abcdefgh"
TOKENED = {"BREAKPOD_LISTENER_TOKEN": TOKEN, "BREAKPOD_REQUIRE_TOKEN": "1"}
GET_IN_SECONDS = 2.0

LOOP = f"""
    import time
    for step in range({ROUNDS} * 10):
        time.sleep(0.005)
        if step % 10 == 5:
            breakpoint()
    print("loop done", step, flush=True)
"""

pytestmark = pytest.mark.timeout(60 + 15 * ROUNDS)


def wait_parks(child: Child, n: int, timeout: float = 15.0) -> int:
    """Wait for the n-th park; its port."""
    deadline = time.monotonic() + timeout
    while child.stderr.count("waiting up to") < n:
        assert time.monotonic() < deadline and child.proc.poll() is None, child.stderr
        time.sleep(0.02)
    return child.park_port()


def get_in(
    port: int, token: str | None = TOKEN, within: float = GET_IN_SECONDS, patience: float = 10.0
) -> float:
    """The real engineer: connect (again, if refused), send the token, reach (Pdb),
    waiting ``patience`` seconds for each answer, continue the job. Returns the
    seconds to the prompt."""
    start = time.monotonic()
    while True:
        client = None
        try:
            client = PdbClient(port, timeout=patience)  # in a flood the connect may time out
            if token is not None:
                client.read_until("\n")
                client.send(token)
            client.read_until("(Pdb) ")
            elapsed = time.monotonic() - start
            client.send("c")
            client.read_all()
            return elapsed
        except (EOFError, OSError):  # refused: another client held the slot
            assert time.monotonic() - start < within, "the real client never got in"
            time.sleep(0.05)
        finally:
            if client is not None:
                client.close()


@contextlib.contextmanager
def attack(target: Callable[[threading.Event], None], threads: int = 1) -> Iterator[None]:
    stop = threading.Event()
    workers = [threading.Thread(target=target, args=(stop,), daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(10)


def finished(child: Child) -> None:
    assert child.wait(timeout=30) == 0, child.stderr
    assert f"loop done {ROUNDS * 10 - 1}" in child.stdout()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def guesser(port: int, guesses: list[int]) -> Callable[[threading.Event], None]:
    """An attacker: one connection per guess, as fast as the listener answers."""

    def guess(stop: threading.Event) -> None:
        while not stop.is_set():
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=10) as s,
            ):
                s.recv(200)
                s.sendall(b"tok-%08d\n" % len(guesses))
                answer = b""
                while chunk := s.recv(200):
                    answer += chunk
                if b"wrong or missing token" in answer:  # judged; not a busy refusal
                    guesses.append(1)

    return guess


@pytest.mark.parametrize("guessers", [1, 4])
def test_guessing_is_slowed_down_and_the_engineer_still_gets_in(spawn, guessers):
    child = spawn(LOOP, env=TOKENED, stdin="closed")
    for n in range(1, ROUNDS + 1):
        port = wait_parks(child, n)
        guesses: list[int] = []
        started = time.monotonic()
        turn = GET_IN_SECONDS + guessers * OVERALL_CAP  # behind the lines sent before it
        with attack(guesser(port, guesses), guessers):
            time.sleep(1.0)  # the delay has grown by now
            elapsed = get_in(port, within=turn)
        seconds = time.monotonic() - started
        assert elapsed < turn
        # one per OVERALL_CAP: was 603/s (one client), 1,420/s (four)
        assert len(guesses) <= seconds / OVERALL_CAP + 1, f"{len(guesses)} in {seconds:.1f}s"
    finished(child)


@pytest.mark.parametrize("sockets", [6, 40])
def test_silent_sockets_do_not_keep_the_engineer_out(spawn, sockets):
    child = spawn(LOOP, env=TOKENED, stdin="closed")
    for n in range(1, ROUNDS + 1):
        port = wait_parks(child, n)
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(sockets)]
        try:
            assert get_in(port) < GET_IN_SECONDS
        finally:
            for s in silent:
                s.close()
    finished(child)


@pytest.mark.parametrize("how", ["sends nothing", "reads nothing"])
def test_an_idle_attached_client_is_dropped_and_the_hold_applies_again(spawn, how):
    env = {**TOKENED, "BREAKPOD_ATTACH_IDLE": "0.5"}
    child = spawn(LOOP, env=env, stdin="closed")
    for n in range(1, ROUNDS + 1):
        port = wait_parks(child, n)
        squatter = PdbClient(port)
        squatter.read_until("\n")
        squatter.send(TOKEN)
        squatter.read_until("(Pdb) ")
        if how == "reads nothing":  # its receive window fills up: the job's send blocks
            squatter.send('p "x" * 20_000_000')
        assert get_in(port, within=GET_IN_SECONDS + 0.5) < GET_IN_SECONDS + 0.5
        squatter.close()
    finished(child)
    assert "sent nothing for 0.5s and was dropped" in child.stderr


def test_an_idle_client_with_nobody_after_it_lets_the_job_go_on(spawn):
    env = {**TOKENED, "BREAKPOD_ATTACH_IDLE": "0.5", "BREAKPOD_HOLD_SECONDS": "0.5"}
    child = spawn(LOOP, env=env, stdin="closed")
    squatters = []
    for n in range(1, ROUNDS + 1):
        squatter = PdbClient(wait_parks(child, n))
        squatter.read_until("\n")
        squatter.send(TOKEN)
        squatter.read_until("(Pdb) ")  # ... and silence, never closing
        squatters.append(squatter)
    finished(child)
    for squatter in squatters:
        squatter.close()


def test_a_16_mib_token_line_is_cut_off_cheaply(spawn):
    child = spawn(LOOP, env=TOKENED, stdin="closed")
    for n in range(1, ROUNDS + 1):
        port = wait_parks(child, n)
        before = cpu_seconds(child.proc.pid)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as s,
            contextlib.suppress(OSError),  # refused after 1 KiB: the rest is not read
        ):
            s.sendall(b"x" * (16 << 20))
        assert get_in(port) < GET_IN_SECONDS
        assert cpu_seconds(child.proc.pid) - before < 1.0
    finished(child)


def test_a_16_mib_pdb_line_costs_little_and_the_session_goes_on(spawn):
    child = spawn(LOOP, stdin="closed")  # loopback, no token: straight to pdb
    for n in range(1, ROUNDS + 1):
        client = PdbClient(wait_parks(child, n))
        client.read_until("(Pdb) ")
        before = cpu_seconds(child.proc.pid)
        client.sock.sendall(b"y" * (16 << 20) + b"\n")  # 16 MiB before the newline
        note = client.read_until("(Pdb) ")  # the prompt again (there was none)
        out = client.command("p step")
        assert cpu_seconds(child.proc.pid) - before < 1.0  # was 31 s (quadratic)
        assert "was ignored" in note and out.strip() == str(10 * n - 5)  # the session goes on
        client.send("c")
        client.read_all()
        client.close()
    finished(child)


def test_a_token_with_a_trailing_newline_or_cr_matches(spawn):
    child = spawn(LOOP, env={**TOKENED, "BREAKPOD_LISTENER_TOKEN": TOKEN + "\n"}, stdin="closed")
    for n in range(1, ROUNDS + 1):
        assert get_in(wait_parks(child, n), token=TOKEN + "\r") < GET_IN_SECONDS
    finished(child)


def test_a_one_character_token_opens_nothing(spawn):
    child = spawn(LOOP, env={**TOKENED, "BREAKPOD_LISTENER_TOKEN": "a"}, stdin="closed")
    finished(child)
    assert "waiting up to" not in child.stderr
    assert (
        child.stderr.count("BREAKPOD_LISTENER_TOKEN must be at least 8") == ROUNDS
    )  # once per break


FLOOD = 200  # connections open at once, each sending a guess as it connects
FLOOD_SECONDS = 60.0 if ROUNDS >= 20 else 15.0
ENGINEER_SECONDS = 300.0 if ROUNDS >= 20 else 30.0
# The job counts the token lines its listener compares (each distinct line one guess
# answered), in a file the test reads: the listener's own count, whatever it tells.
COUNTED = """
    import hmac, time
    _compare = hmac.compare_digest
    def compare(line, token):
        with open({log!r}, "a") as log:
            log.write(f"{{time.monotonic()}} {{line.hex()}}\\n")
        return _compare(line, token)
    hmac.compare_digest = compare
"""


def flooder(port: int, judged: list[float]) -> Callable[[threading.Event], None]:
    """One connection per guess, the guess sent at once, a new one as soon as it ends."""

    def guess(stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=30) as s,
            ):
                s.sendall(b"tok-%d-%d\n" % (threading.get_ident(), n))
                answer = b""
                s.settimeout(0.5)  # waiting its turn; closed when the flood stops
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        if not (chunk := s.recv(200)):
                            break
                        answer += chunk
                if b"wrong or missing token" in answer:  # told: one guess answered
                    judged.append(time.monotonic())
                assert b"(Pdb)" not in answer and b"attached" not in answer

    return guess


def compared(log: Path, start: float, end: float) -> int:
    """Distinct token lines the listener compared between ``start`` and ``end``."""
    lines = [line.split() for line in log.read_text().splitlines()]
    return len({value for when, value in lines if start <= float(when) <= end})


@pytest.mark.timeout(120 + FLOOD_SECONDS + ENGINEER_SECONDS)
def test_200_parallel_guessers_guess_at_most_2_a_second(spawn, tmp_path):
    """Each connection's line was compared as it came (a right one got in at once; the
    delay only held back refusals, and each new connection pushed out the oldest):
    227-294 guesses a second with 200 open. Now one comparison per throttle opening,
    right or wrong. Measures how long the engineer with the token waits meanwhile."""
    log = tmp_path / "compared.log"
    script = textwrap.dedent(COUNTED.format(log=str(log))) + textwrap.dedent(LOOP)
    child = spawn(script, env={**TOKENED, "BREAKPOD_HOLD_SECONDS": "forever"}, stdin="closed")
    port = wait_parks(child, 1)
    judged: list[float] = []
    with attack(flooder(port, judged), FLOOD):
        time.sleep(2.0)  # the flood is on, the delay at its cap
        start = time.monotonic()
        try:
            waited: float | None = get_in(port, within=ENGINEER_SECONDS, patience=ENGINEER_SECONDS)
        except AssertionError:
            waited = None
        time.sleep(max(0.0, FLOOD_SECONDS - (time.monotonic() - start)))
        end = time.monotonic()
    rate = compared(log, start, end) / (end - start)
    told_rate = len([t for t in judged if start <= t <= end]) / (end - start)
    shown = f"{waited:.1f}s" if waited is not None else f"more than {ENGINEER_SECONDS:g}s"
    print(
        f"\n{FLOOD} parallel guessers over {end - start:.0f}s: {rate:.2f} guesses/s compared, "
        f"{told_rate:.2f}/s told wrong; the engineer with the token waited {shown}"
    )
    assert rate <= 2.0, f"{rate:.1f} guesses/s"
    for n in range(2 if waited is not None else 1, ROUNDS + 1):  # the rest, unattacked
        get_in(wait_parks(child, n))
    finished(child)
