"""Why a container's process died, from the Docker engine's events (``BREAKPOD_DOCKER_WATCH``).

``auto`` (the default): watched when the ``docker`` package is installed
(``pip install 'breakpod-broker[docker]'``) and the engine answers (``DOCKER_HOST``
or its socket, as the docker CLI finds it); otherwise one line says why not.
``on``: the broker does not start without it. ``off``: never.

The engine's ``oom`` and ``die`` events of containers are read in a thread (the
SDK's stream blocks) and handed to the loop. A ``die`` names the exit code; an
``oom`` near it (or the container's ``State.OOMKilled``) makes it OOMKilled. The
engine reads a cgroup's oom apart from its process's exit, and under load the
``die`` can come first: a SIGKILL's death waits up to ``OOM_GRACE`` for its oom,
each death in its own task, so that a node's worth of deaths never queue. The
container is matched to its sessions by the 12-digit id the agent reports
(``container``, or ``host``: a container's hostname is that id unless set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Any

from breakpod import protocol
from breakpod_broker import keys, reasons
from breakpod_broker.context import Broker

log = logging.getLogger(__name__)
OOM_SECONDS = 30.0  # an oom event marks its container's next die this long
OOM_GRACE = 3.0  # a SIGKILL's die waits this long for an oom that comes after it
OOM_POLL = 0.25
SIGKILLED = 128 + signal.SIGKILL  # the exit code of a process the OOM killer took


class DockerWatchError(RuntimeError):
    """BREAKPOD_DOCKER_WATCH=on, and the engine cannot be watched."""


class DockerWatch:
    """The replica's reader of the engine's container events."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.client: Any = None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.oom: dict[str, float] = {}  # container id (12) -> when its oom event came
        self.recorded = 0
        self.stream: Any = None
        self.thread = threading.Thread(target=self._read, name="docker-events", daemon=True)
        self.task: asyncio.Task[None] | None = None
        self.handling: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, broker: Broker) -> DockerWatch | None:
        """The watch (None when off). ``on``: connected before the broker serves, or
        DockerWatchError; ``auto``: it connects in the background (start-up never
        waits on an engine), or says once why it does not watch."""
        mode = broker.settings.docker_watch
        if mode == "off":
            return None
        watch = cls(broker)
        if mode == "on":
            watch._connect(await asyncio.to_thread(_connect))
        watch.task = asyncio.create_task(watch._run())
        return watch

    def _connect(self, client: Any) -> None:
        self.client = client
        self.stream = client.events(
            decode=True, filters={"type": "container", "event": ["die", "oom"]}
        )
        self.thread.start()
        log.info("docker watch: reading the engine's container events")

    async def _run(self) -> None:
        if self.client is None:
            try:
                self._connect(await asyncio.to_thread(_connect))
            except DockerWatchError as e:
                log.info("docker watch off: %s", e)
                return
        await self._handle_all()

    async def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):  # the SDK's stream closes its socket
                await asyncio.to_thread(self.stream.close)
        for task in (self.task, *self.handling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()

    def _read(self) -> None:
        try:
            for event in self.stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except Exception as e:  # closed at shutdown, or the engine went away
            log.info("docker watch: the engine's event stream ended (%s)", e)

    async def _handle_all(self) -> None:
        while True:
            task = asyncio.create_task(self._handle_one(await self.queue.get()))
            self.handling.add(task)
            task.add_done_callback(self.handling.discard)

    async def _handle_one(self, event: dict[str, Any]) -> None:
        try:
            await self.handle(event)
        except Exception:  # one bad event or a Redis error never stops the watch
            log.exception("docker watch: cannot record %s", event.get("id"))

    async def handle(self, event: dict[str, Any]) -> None:
        action = event.get("Action") or event.get("status") or ""
        container = str(event.get("id") or event.get("Actor", {}).get("ID") or "")[:12]
        if action == "oom":
            self.oom = {c: t for c, t in self.oom.items() if time.monotonic() - t < OOM_SECONDS}
            self.oom[container] = time.monotonic()
            return
        if action != "die" or not container:
            return
        attributes = event.get("Actor", {}).get("Attributes", {})
        code = _int(attributes.get("exitCode"))
        kind, fields = reasons.of_exit(code, oom=await self._oom_killed(container, code))
        fields.update(source=protocol.DOCKER, container=container)
        sessions = await reasons.sessions_where(
            self.broker, keys.SESSIONS, lambda f: _runs_in(f, container)
        )
        event_id = f"docker-{container}-{event.get('timeNano') or event.get('time')}"
        self.recorded += await reasons.record(self.broker, sessions, kind, fields, event_id)

    async def _oom_killed(self, container: str, code: int | None) -> bool:
        """An oom event came for the container, or it says so itself. A SIGKILL waits up
        to OOM_GRACE for the event, since it can come after the die; the engine is asked
        once, at the end (it sets State.OOMKilled as it sends the event)."""
        deadline = time.monotonic() + (OOM_GRACE if code == SIGKILLED else 0.0)
        while container not in self.oom and time.monotonic() < deadline:
            await asyncio.sleep(OOM_POLL)  # a look at this dict: the engine is not asked
        return container in self.oom or await asyncio.to_thread(self._says_oom_killed, container)

    def _says_oom_killed(self, container: str) -> bool:
        """The container's own word (gone already when it ran with --rm: then no)."""
        try:
            return bool(self.client.containers.get(container).attrs["State"]["OOMKilled"])
        except Exception:
            return False


def _runs_in(fields: dict[str, str], container: str) -> bool:
    return container in (fields.get("container"), fields.get("host"))


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _connect() -> Any:
    """A client of a reachable engine, or DockerWatchError saying why not."""
    try:
        import docker  # optional: breakpod-broker[docker]
    except ImportError:
        docker = None  # type: ignore[assignment]
    # (a folder named docker on sys.path imports as an empty namespace: not the SDK)
    from_env = getattr(docker, "from_env", None)
    if from_env is None:
        raise DockerWatchError(
            "the docker package is not installed (pip install 'breakpod-broker[docker]')"
        )
    try:
        client = from_env(timeout=5)
        client.ping()
    except Exception as e:
        raise DockerWatchError(f"no Docker engine answers ({e})") from e
    return client
