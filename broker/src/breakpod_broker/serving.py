"""Serving the broker app with uvicorn: optional TLS, and a clean, bounded shutdown.

On SIGTERM/SIGINT uvicorn stops accepting and waits for running requests;
``closing`` is set at that moment so command long-polls answer 503 at once
(the agent polls again, on another replica or after the restart) instead of
being cancelled mid-request with a traceback.

The shutdown has ``shutdown_seconds`` (BREAKPOD_SHUTDOWN_SECONDS). A broker still
running then, or sent a second SIGTERM/SIGINT before it finished (uvicorn itself
heeds only a second SIGINT), gives up: it stops its embedded redis-server and
exits 1, saying why on stderr. The deadline is a thread of its own, so a main
thread stuck anywhere (an await that never returns under load) cannot hold the
process, nor leave its redis-server behind.

uvicorn's httptools protocol writes a response's status line and headers, then
its body, each with its own ``transport.write``: two sends (and two TCP
segments) per answer. ``CorkedHttpTools`` gives it a transport that joins the
writes made in one turn of the event loop into one, sent at the end of the
turn: a job-wide ``break`` answers thousands of polls at once, and the second
send was ~15% of the broker's CPU per answer (and a second wake-up of the
agent's reader).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn's default protocol, uncorked
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from breakpod_broker import redis_server
from breakpod_broker.settings import BrokerSettings

GRACEFUL_SECONDS = 3  # SSE streams never end by themselves
GAVE_UP = 1  # the exit status of a shutdown that overran its deadline or was cut short
# uvicorn logs each request at INFO; above it the line is dropped, but uvicorn still
# formats its arguments (client address, quoted path): ~10% of a command poll's
# answer when a job-wide ``break`` answers thousands at once (profiled)
ACCESS_LOG_LEVELS = ("debug", "info")


class Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins."""

    def __init__(self, config: uvicorn.Config, closing: asyncio.Event, deadline: float) -> None:
        super().__init__(config)
        self.closing = closing
        self.deadline = deadline
        self.loop: asyncio.AbstractEventLoop | None = None
        self._giving_up = threading.Lock()

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:  # a second signal: never ignored
            why = f"a second {name} before the shutdown finished"
            _in_thread(self.give_up, why)
        else:
            why = f"the shutdown after {name} took longer than {self.deadline:g}s"
            timer = threading.Timer(self.deadline, self.give_up, (why,))
            timer.daemon = True
            timer.start()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.closing.set)
        super().handle_exit(sig, frame)

    def give_up(self, why: str) -> None:
        """Stop the embedded redis-server and exit now (any thread, once)."""
        if not self._giving_up.acquire(blocking=False):
            return
        stopped = redis_server.stop_all_now()
        then = "stopped its embedded redis-server and " if stopped else ""
        line = f"breakpod-broker: error: {why}: {then}exits {GAVE_UP}\n"
        os.write(sys.stderr.fileno(), line.encode())  # no lock the stuck thread may hold
        os._exit(GAVE_UP)  # no interpreter shutdown: it would wait for the stuck thread


def _in_thread(target: Any, *args: Any) -> None:
    threading.Thread(target=target, args=args, name="broker-give-up", daemon=True).start()


class CorkedTransport:
    """A transport whose writes within one turn of the event loop leave as one write."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:  # everything else: the transport's own
        return getattr(self._transport, name)


if HttpToolsProtocol is not None:

    class CorkedHttpTools(HttpToolsProtocol):
        """uvicorn's httptools protocol on a CorkedTransport."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CorkedTransport(transport))  # type: ignore[arg-type]


def serve(app: FastAPI, settings: BrokerSettings, log_level: str) -> None:
    closing = asyncio.Event()
    app.state.closing = closing
    tls: dict[str, Any] = {}
    if settings.tls_cert_file is not None:
        tls = {"ssl_certfile": str(settings.tls_cert_file)}
        if settings.tls_key_file is not None:
            tls["ssl_keyfile"] = str(settings.tls_key_file)
    config = uvicorn.Config(
        app,
        host=settings.broker_host,
        port=settings.broker_port,
        log_level=log_level,
        access_log=log_level in ACCESS_LOG_LEVELS,
        http=CorkedHttpTools if HttpToolsProtocol is not None else "auto",
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
        proxy_headers=False,  # the broker's trusted_proxies decide whom to believe (proxies.py)
        **tls,
    )
    Server(config, closing, settings.shutdown_seconds).run()
