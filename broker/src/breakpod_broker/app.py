"""The ASGI app: ``create_app(settings)`` for uvicorn, tests and the CLI.

    uvicorn --factory breakpod_broker.app:create_app

Everything stateful is in Redis, so any number of these processes can share
one Redis. Settings are read in the lifespan (not at import); without a Redis
URL the lifespan starts an embedded redis-server and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import logging
import reprlib
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from breakpod import protocol
from breakpod_broker import (
    __version__,
    admin,
    attach,
    commands,
    dashboard,
    events,
    joblog,
    listing,
    logins,
    redis_clients,
    sessions,
)
from breakpod_broker.context import Broker
from breakpod_broker.deaths import Deaths
from breakpod_broker.docker_watch import DockerWatch
from breakpod_broker.events import _decode
from breakpod_broker.fanout import EventFanout, within
from breakpod_broker.fastpath import (
    EventsFastPath,
    HeartbeatFastPath,
    PollFastPath,
    bearer,
    read_body,
    refuse,
    replay_body,
)
from breakpod_broker.limits import unpaired_in_body
from breakpod_broker.liveness import Liveness
from breakpod_broker.metrics import Metrics
from breakpod_broker.notifiers import Dispatcher
from breakpod_broker.pod_watch import PodWatch
from breakpod_broker.proxies import TrustedProxies
from breakpod_broker.redis_server import EmbeddedRedis
from breakpod_broker.scripts import Scripts
from breakpod_broker.settings import BrokerSettings
from breakpod_broker.tokens import Principal, TokenStore, load_tokens_file, parse_token_pairs
from breakpod_broker.wakeups import CommandWakeups

log = logging.getLogger(__name__)
REDIS_ERROR_LOG_SECONDS = 5.0  # 10,000 polls failing at once logged 74,000 lines


def create_app(settings: BrokerSettings | None = None) -> FastAPI:
    """The broker app; ``settings`` default to the environment, read at startup."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _running(settings or BrokerSettings()) as broker:
            app.state.broker = broker
            closing: asyncio.Event | None = getattr(app.state, "closing", None)
            shut = asyncio.create_task(_shut_when(closing, broker.wakeups)) if closing else None
            # what start-up built (modules, models, routes, clients: ~100k objects) lives
            # as long as the process: out of the collector's full passes, which took
            # 0.2 s of CPU each under a job-wide break to 10,000 polls (bench/scale.py)
            gc.freeze()
            try:
                yield
            finally:
                if shut is not None:
                    shut.cancel()

    # no public /docs: every endpoint but the health checks needs a token, the schema too
    app = FastAPI(
        title="breakpod broker",
        version=__version__,
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        **_without_native_telemetry(),
    )
    for module in (sessions, listing, events, commands, attach, admin, dashboard):
        app.include_router(module.router)
    _add_error_handlers(app)
    app.add_middleware(EventsFastPath)  # inside BodyLimit: the same 413 for a large body
    app.add_middleware(BodyLimit)
    app.add_middleware(HeartbeatFastPath)  # outside BodyLimit: it reads the few bytes itself
    app.add_middleware(PollFastPath)  # a GET: no body to limit
    app.add_middleware(TrustedProxies)  # outermost: every route sees the client's scheme
    return app


async def _shut_when(closing: asyncio.Event, wakeups: CommandWakeups) -> None:
    """Once the server begins to shut down (serving.py), waiting command polls answer
    503 at once: one task per replica, not one per poll."""
    await closing.wait()
    wakeups.shut()


@contextlib.asynccontextmanager
async def _running(settings: BrokerSettings) -> AsyncIterator[Broker]:
    """The broker's resources; whatever was started is stopped again, also when
    a later step of the start-up fails (an embedded server is never left behind)."""
    async with contextlib.AsyncExitStack() as stack:
        embedded = None
        if settings.redis_url is None:
            embedded = await asyncio.to_thread(EmbeddedRedis(settings.data_dir / "redis").start)
            stack.push_async_callback(asyncio.to_thread, embedded.stop)
            settings = settings.model_copy(update={"redis_url": embedded.url})
        assert settings.redis_url is not None
        clients = await redis_clients.connect(settings.redis_url, settings)
        client, blocking = clients.ordinary, clients.blocking
        stack.push_async_callback(blocking.aclose)
        stack.push_async_callback(client.aclose)
        static = _static_tokens(settings)
        metrics = Metrics()
        notifiers = Dispatcher(
            settings.notifiers,
            client,
            metrics,
            blocking,
            settings.notify_claim_seconds,
            settings.notify_max_age,
        )
        stack.push_async_callback(notifiers.close)
        await notifiers.start()
        reader = redis_clients.own_client(settings.redis_url, clients.cluster)
        fanout = EventFanout(reader, settings.follower_queue, _decode)
        stack.push_async_callback(fanout.redis.aclose)
        stack.push_async_callback(fanout.close)
        await fanout.start()
        wakeups = CommandWakeups(redis_clients.subscriber(settings.redis_url))
        stack.push_async_callback(wakeups.close)
        await wakeups.start()
        liveness = Liveness(settings, client)
        stack.push_async_callback(liveness.close)
        await liveness.count()
        broker = Broker(
            settings,
            client,
            TokenStore(static, client),
            metrics,
            notifiers,
            Scripts.register_with(client),
            blocking=blocking,
            embedded=embedded,
            fanout=fanout,
            wakeups=wakeups,
            cluster=clients.cluster,
            liveness=liveness,
        )
        # a job-wide command's new entries read once for all the polls it wakes
        wakeups.read_job = functools.partial(joblog.after, broker)
        deaths = Deaths(broker)  # every replica sweeps; one records each death
        stack.push_async_callback(deaths.close)
        deaths.start()
        for watch in (await DockerWatch.start(broker), await PodWatch.start(broker)):
            if watch is not None:  # why a process died, where the runtime can tell
                stack.push_async_callback(watch.close)
        yield broker


def _static_tokens(settings: BrokerSettings) -> dict[str, Principal]:
    static = parse_token_pairs(settings.broker_tokens)
    if settings.tokens_file is not None:
        static.update(load_tokens_file(settings.tokens_file))
    if not static:
        log.warning("no tokens configured: only API-made tokens work (set BREAKPOD_BROKER_TOKENS)")
    return static


def _without_native_telemetry() -> dict[str, Any]:
    """FastAPI's native OpenTelemetry (0.165 and later) asks the global providers about
    every request: 5% of a busy replica's CPU. The broker's metrics are its own
    (``/metrics``), so it is off; older FastAPI has none."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def _add_error_handlers(app: FastAPI) -> None:
    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = [_describe(e) for e in exc.errors()]
        detail = {
            "message": "invalid request: " + "; ".join(problems),
            "errors": _jsonable(exc.errors()),
        }
        return JSONResponse(detail, status_code=422)

    async def redis_refused(request: Request, exc: Exception) -> JSONResponse:
        # a command Redis rejects is a request the broker let through: bad input
        log.info("Redis refused %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": f"Redis refused the request: {exc}"}, 400)

    quiet = LogThrottle(REDIS_ERROR_LOG_SECONDS)

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        if (more := quiet.due()) is not None:  # under overload, one line per period
            also = f" (and {more} more since the last such line)" if more else ""
            log.warning("Redis error on %s %s: %s%s", request.method, request.url.path, exc, also)
        return JSONResponse(
            {"detail": f"Redis is unavailable ({type(exc).__name__}); retry later"}, 503
        )

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(redis.exceptions.ResponseError, redis_refused)
    app.add_exception_handler(redis.exceptions.RedisError, redis_down)


class LogThrottle:
    """``due()``: the number of calls it swallowed since the last time it said yes, once
    per ``seconds``; None in between."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = -seconds
        self.swallowed = 0

    def due(self) -> int | None:
        now = time.monotonic()
        if now - self.last < self.seconds:
            self.swallowed += 1
            return None
        self.last, swallowed, self.swallowed = now, self.swallowed, 0
        return swallowed


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error.get('msg', 'invalid')}"


def _jsonable(errors: Any) -> Any:
    """Validation errors echo the input: containers as a short repr (they may be
    nested too deep for any encoder), NaN and infinities as strings, exceptions
    (pydantic's ``ctx.error``) as their message."""
    shown = [{**e, "input": _short(e.get("input"))} for e in errors]
    return protocol.finite(jsonable_encoder(shown, custom_encoder={Exception: str, bytes: str}))


def _short(value: Any) -> Any:
    if isinstance(value, dict | list | tuple):
        return reprlib.repr(value)
    return value


OPEN_BODY_BYTES = 64 * 1024  # a body anyone may send (a login); more needs credentials


class BodyLimit:
    """Request bodies, read before any route: 413 over ``max_body_bytes`` (declared or
    streamed); 401 over :data:`OPEN_BODY_BYTES` without a token or login the broker
    knows (nobody unknown makes a replica hold a megabyte per connection); 408 when
    not all received within ``body_seconds``; 422 for one holding half of a UTF-16
    pair (:func:`.limits.unpaired_in_body`), which no route could store or answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = scope["app"].state.broker.settings
        limit: int = settings.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        try:
            if declared.isdigit() and int(declared) > limit:
                raise _too_large(limit)
            body = await within(settings.body_seconds, _read(scope, receive, limit))
        except TimeoutError:
            seconds = settings.body_seconds
            await refuse(send, HTTPException(408, f"the body did not arrive within {seconds:g}s"))
            return
        except HTTPException as refused:
            await refuse(send, refused)
            return
        await self.app(scope, replay_body(body, True, receive), send)


async def _read(scope: Scope, receive: Receive, limit: int) -> bytes:
    body, complete = await read_body(receive, OPEN_BODY_BYTES)
    if len(body) > OPEN_BODY_BYTES and not await _credentialed(scope):
        message = f"a request body over {OPEN_BODY_BYTES} bytes needs the broker's token"
        raise HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})
    if not complete and len(body) <= limit:
        rest, _ = await read_body(receive, limit - len(body))
        body += rest
    if len(body) > limit:
        raise _too_large(limit)
    if (path := unpaired_in_body(body)) is not None:
        where = ".".join(["body", *map(str, path)])
        raise HTTPException(
            422,
            f"{where}: a string holds half of a UTF-16 surrogate pair (an escape such as "
            '"\\ud800" with no partner), which is not text: send valid Unicode',
        )
    return body


async def _credentialed(scope: Scope) -> bool:
    """Does the request carry a token or a dashboard login the broker knows?"""
    broker = scope["app"].state.broker
    try:
        if (token := bearer(scope)) is not None:
            return await broker.tokens.lookup(token) is not None
        cookie = Request(scope).cookies.get(logins.COOKIE)
        return cookie is not None and await logins.lookup(broker, cookie) is not None
    except redis.exceptions.RedisError:
        return True  # the route answers (503)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body larger than {limit} bytes: send smaller batches")
