"""Bodies trickled to the broker a byte at a time, on the routes nobody needs a token
for: each connection is answered 408 once ``BREAKPOD_BODY_SECONDS`` have passed, and
the broker holds no file descriptor for it after that.

``make test`` opens a few hundred such connections; ``make chaos`` (CHAOS_ROUNDS=20)
opens 2,000, as the attack that found the heartbeat's fast path outside the deadline
(its open files went from 18 to 2,017, held as long as the client liked).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

from tests.brokerkit import register, wait_until
from tests.chaos.kit import ROUNDS

CONNECTIONS = 2000 if ROUNDS >= 20 else 300
DEADLINE = 2.0
HEAD = (
    "POST /v1/sessions/{sid}/heartbeat HTTP/1.1\r\nHost: b\r\n"
    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def trickle(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that announced 100 body bytes and sent one."""
    socks = []
    for i in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(HEAD.format(sid=f"s{i % 7}").encode())
        socks.append(sock)
    return socks


def status_of(sock: socket.socket) -> int:
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data and (chunk := sock.recv(4096)):
            data += chunk
    return int(data.split()[1]) if data.startswith(b"HTTP/") else 0


@pytest.mark.timeout(120)
def test_trickled_heartbeats_are_answered_408_and_hold_nothing_past_the_deadline(start_broker):
    broker = start_broker(BREAKPOD_BODY_SECONDS=str(DEADLINE))
    register(broker, "s0")
    assert broker.proc is not None
    pid = broker.proc.pid
    before = open_files(pid)
    started = time.monotonic()
    socks = trickle(broker.port, CONNECTIONS)
    try:
        for sock in socks[: CONNECTIONS // 2]:  # another byte: a trickle, not a pause
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
        wait_until(lambda: open_files(pid) <= before + 10, timeout=DEADLINE + 30, interval=0.2)
        freed_after = time.monotonic() - started
        statuses = [status_of(s) for s in socks]
    finally:
        for sock in socks:
            sock.close()
    assert statuses.count(408) == CONNECTIONS, {s: statuses.count(s) for s in set(statuses)}
    print(
        f"{CONNECTIONS} trickled heartbeats: all 408, files back to {before} after "
        f"{freed_after:.1f}s (deadline {DEADLINE:g}s)"
    )
    with broker.client("agent-token-0001") as c:  # the broker serves on
        assert c.post("/v1/sessions/s0/heartbeat", json={}).status_code == 200
