"""Serving the broker app with uvicorn: optional TLS, and a clean shutdown.

On SIGTERM/SIGINT uvicorn stops accepting and waits for running requests;
``closing`` is set at that moment so command long-polls answer 503 at once
(the agent polls again, on another replica or after the restart) instead of
being cancelled mid-request with a traceback.
"""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from breakpod_broker.settings import BrokerSettings

GRACEFUL_SECONDS = 3  # SSE streams never end by themselves


class Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins."""

    def __init__(self, config: uvicorn.Config, closing: asyncio.Event) -> None:
        super().__init__(config)
        self.closing = closing
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.closing.set)
        super().handle_exit(sig, frame)


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
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
        **tls,
    )
    Server(config, closing).run()
