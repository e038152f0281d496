"""The broker's Redis connections on its own event loop (uvloop): a Redis that resets a
connection as it opens (killed, or restarting) is a ConnectionError, answered 503, never
an error redis-py does not know (a 500)."""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter

import pytest
import redis
import redis.asyncio as aioredis

from breakpod_broker.redis_clients import connection_class

uvloop = pytest.importorskip("uvloop")


def resetting_server() -> tuple[socket.socket, int]:
    """A TCP server that resets every connection right after accepting it."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the test is over
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # SO_LINGER 0: an RST, as from a killed Redis

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_connection_reset_as_it_opens_is_a_connection_error():
    server, port = resetting_server()
    url = f"redis://127.0.0.1:{port}/0"

    async def connect_many() -> Counter[str]:
        seen: Counter[str] = Counter()
        for _ in range(300):
            pool = aioredis.ConnectionPool.from_url(url, **connection_class(url))
            try:
                await pool.get_connection()
            except Exception as e:  # what a route would see
                seen[type(e).__name__ if isinstance(e, redis.RedisError) else repr(e)] += 1
            await pool.disconnect()
        return seen

    try:
        seen = uvloop.run(connect_many())
    finally:
        server.close()
    # uvloop raised RuntimeError("... the handler is closed") for a few in a hundred
    assert set(seen) <= {"ConnectionError", "TimeoutError"}, seen
    assert sum(seen.values()) == 300
