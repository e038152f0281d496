"""The broker's Redis clients, for one Redis or a Redis Cluster.

One Redis: connection pools that wait for a free connection. A Redis Cluster
(``BREAKPOD_REDIS_CLUSTER=true``, or unset and the server at the URL says
``cluster_enabled:1``): redis-py's asyncio ``RedisCluster``, which routes each
command to the node owning its key's slot; the URL names any one node. Pub/sub
messages reach every node of a cluster, so the command subscription is a plain
client on that node.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError

try:
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # an older redis-py: its own packer
    HIREDIS_AVAILABLE = False

from breakpod_broker.fanout import BLOCK_MS
from breakpod_broker.settings import BrokerSettings

REDIS_TIMEOUT = 5.0  # seconds, for every non-blocking command and connection
# connections per replica for ordinary commands: a burst of thousands of long polls
# (every agent of a job at once) waited past REDIS_TIMEOUT for one of 64
POOL = 256
CLUSTER_CONNECTIONS = 1000  # per node; RedisCluster fails (not waits) past it


def _hiredis_serializer() -> Any:
    """hiredis' packer, or None (redis-py 8 left its constructor untyped)."""
    if not HIREDIS_AVAILABLE:
        return None
    make: Callable[..., Any] = HiredisRespSerializer
    return make()


_SERIALIZER = _hiredis_serializer()


class _LostConnection:
    """uvloop (the broker's loop) raises RuntimeError ("the handler is closed") where
    asyncio's own loop raises OSError, when a command is written to a connection Redis
    reset as it opened (a Redis killed or restarting): redis-py lets it through, and
    the request would answer 500. It is a lost connection like any other: 503."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as e:
            if "closed" not in str(e):
                raise
            raise ConnectionError(f"Redis closed the connection: {e}") from e


class _HiredisPacked:
    """A connection that packs commands with hiredis (C), as redis-py's sync client does
    when hiredis is installed; its asyncio client packs in Python, ~60 us for one
    ingest batch's Lua call of 50 events (8x hiredis). The same bytes, the same errors."""

    def pack_command(self, *args: Any) -> list[bytes]:
        assert _SERIALIZER is not None  # used only with hiredis
        packed: list[bytes] = _SERIALIZER.pack(*args)
        return packed


def _classes(*mixins: type) -> dict[str, type]:
    bases = {"redis": Connection, "rediss": SSLConnection, "unix": UnixDomainSocketConnection}
    return {k: type(f"_{base.__name__}", (*mixins, base), {}) for k, base in bases.items()}


CONNECTIONS = (
    _classes(_LostConnection, _HiredisPacked) if HIREDIS_AVAILABLE else _classes(_LostConnection)
)


def connection_class(url: str) -> dict[str, Any]:
    """The connection class of every single-Redis client the broker makes: a lost
    connection is a ConnectionError on any loop, and commands are packed by hiredis
    when it is installed. (RedisCluster makes its connections with a class of its own:
    there a reset under uvloop still raises the RuntimeError.)"""
    scheme = urllib.parse.urlsplit(url).scheme
    return {"connection_class": CONNECTIONS[scheme]} if scheme in CONNECTIONS else {}


@dataclasses.dataclass(frozen=True)
class Clients:
    ordinary: Any
    blocking: Any  # BLMOVE / XREADGROUP BLOCK: a socket timeout longer than any block
    cluster: bool


async def is_cluster(url: str, setting: bool | None) -> bool:
    """The setting when given, else what the server at ``url`` says."""
    if setting is not None:
        return setting
    probe = aioredis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT)
    try:
        info = await probe.info("cluster")
    except Exception:  # unreachable now: one Redis (the broker starts without Redis)
        return False
    finally:
        await probe.aclose()
    return bool(info.get("cluster_enabled"))


async def connect(url: str, settings: BrokerSettings) -> Clients:
    """(ordinary, blocking) clients. Ordinary commands time out after REDIS_TIMEOUT
    and wait at most that long for a pooled connection; blocking ones (BLMOVE,
    XREAD BLOCK) may take up to max_poll_seconds + SSE block."""
    common: dict[str, Any] = {"decode_responses": True, "socket_connect_timeout": REDIS_TIMEOUT}
    blocking_timeout = settings.max_poll_seconds + REDIS_TIMEOUT + 5
    if await is_cluster(url, settings.redis_cluster):
        return Clients(
            _cluster(url, REDIS_TIMEOUT, common),
            _cluster(url, blocking_timeout, common),
            cluster=True,
        )
    common["health_check_interval"] = 30
    common.update(connection_class(url))
    ordinary = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=POOL, timeout=REDIS_TIMEOUT, socket_timeout=REDIS_TIMEOUT, **common
    )
    blocking = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings.max_waiters + 1,  # + the notifier queue's reader
        timeout=REDIS_TIMEOUT,
        socket_timeout=blocking_timeout,
        **common,
    )
    return Clients(
        aioredis.Redis.from_pool(ordinary), aioredis.Redis.from_pool(blocking), cluster=False
    )


def _cluster(url: str, socket_timeout: float, common: dict[str, Any]) -> Any:
    return RedisCluster.from_url(
        url, socket_timeout=socket_timeout, max_connections=CLUSTER_CONNECTIONS, **common
    )


def own_client(url: str, cluster: bool) -> Any:
    """A client of its own for one long-lived reader (the fan-out's XREAD BLOCK):
    never queued behind ordinary requests."""
    timeout = REDIS_TIMEOUT + BLOCK_MS / 1000
    if cluster:
        return RedisCluster.from_url(
            url, decode_responses=True, socket_connect_timeout=REDIS_TIMEOUT, socket_timeout=timeout
        )
    return subscriber(url, timeout)


def subscriber(url: str, timeout: float = REDIS_TIMEOUT + BLOCK_MS / 1000) -> Any:
    """A plain client on the node at ``url`` (in a cluster: pub/sub reaches every node)."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=REDIS_TIMEOUT,
        socket_timeout=timeout,
        max_connections=2,
        **connection_class(url),
    )
