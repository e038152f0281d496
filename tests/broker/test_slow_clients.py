"""Clients that hold a replica's resources without finishing: a body that never
arrives, a large body from nobody the broker knows, a stream nobody reads. Each is
a real socket against a real broker process."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.brokerkit import AGENT, VIEWER, post_events, register, wait_until


def raw_request(broker, head: str, body: bytes = b"") -> socket.socket:
    """A connection that sent ``head`` (the request line and headers) and ``body``."""
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
    sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    return sock


def post_head(length: int, token: str | None = None) -> str:
    auth = f"Authorization: Bearer {token}\n" if token else ""
    return (
        f"POST /v1/events HTTP/1.1\nHost: b\n{auth}Content-Type: application/json\n"
        f"Content-Length: {length}\n"
    )


def answer(sock: socket.socket) -> tuple[int, str]:
    """The status and body of the response, read until the server closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


@pytest.mark.timeout(30)
def test_a_body_that_never_finishes_gets_408_and_its_connection_closes(start_broker):
    broker = start_broker(BREAKPOD_BODY_SECONDS="1")
    started = time.monotonic()
    with raw_request(broker, post_head(1000, AGENT), b'{"events": [') as sock:
        status, body = answer(sock)  # the server closes: it returns
    assert status == 408 and "within 1s" in json.loads(body)["detail"]
    assert time.monotonic() - started < 8


@pytest.mark.timeout(30)
def test_only_a_known_token_makes_the_broker_read_a_large_body(broker):
    register(broker, "s1")
    for token in (None, "not-a-token"):
        with raw_request(broker, post_head(1_000_000, token), b" " * 70_000) as sock:
            status, body = answer(sock)  # answered without the rest of the megabyte
        assert status == 401 and "token" in json.loads(body)["detail"], body
    blob = "x" * 60_000
    events = [
        {"id": f"big{i}", "session": "s1", "kind": "log", "fields": {"b": blob}} for i in range(4)
    ]
    taken = post_events(broker, *events)  # 240 kB from the agent's token
    assert taken.status_code == 200 and taken.json()["accepted"] == 4, taken.text


@pytest.mark.timeout(60)
def test_a_stream_whose_client_stopped_reading_ends_and_frees_its_place(start_broker):
    broker = start_broker(
        BREAKPOD_MAX_FOLLOWERS="2",
        BREAKPOD_FOLLOWER_QUEUE="10",
        BREAKPOD_STREAM_STALL_SECONDS="1",
    )
    register(broker, "s1")
    head = f"GET /v1/events/stream HTTP/1.1\nHost: b\nAuthorization: Bearer {VIEWER}\n"
    stuck = []
    for _ in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", broker.port))
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")  # and never read again
        stuck.append(sock)
    blob = "x" * 60_000
    for batch in range(30):  # 18 MB: more than both ends' socket buffers hold
        events = [
            {"id": f"e{batch}.{i}", "session": "s1", "kind": "log", "fields": {"b": blob}}
            for i in range(10)
        ]
        assert post_events(broker, *events).status_code == 200

    def a_stream_is_served() -> bool:
        with (
            httpx.Client(base_url=broker.url, timeout=10) as c,
            c.stream(
                "GET", "/v1/events/stream", headers={"Authorization": f"Bearer {VIEWER}"}
            ) as reply,
        ):
            return reply.status_code == 200

    assert wait_until(a_stream_is_served, timeout=20, interval=0.5)
    for sock in stuck:
        sock.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("token", [None, AGENT])
def test_a_heartbeat_body_that_never_finishes_gets_408(start_broker, token):
    """The heartbeat's fast path reads its few bytes itself: under the same deadline
    (it answered nothing at all, and held the connection for ever)."""
    broker = start_broker(BREAKPOD_BODY_SECONDS="1")
    auth = f"Authorization: Bearer {token}\n" if token else ""
    head = f"POST /v1/sessions/s1/heartbeat HTTP/1.1\nHost: b\n{auth}Content-Length: 100\n"
    started = time.monotonic()
    with raw_request(broker, head, b"{") as sock:
        status, body = answer(sock)
    assert status == 408 and "within 1s" in json.loads(body)["detail"]
    assert time.monotonic() - started < 8
