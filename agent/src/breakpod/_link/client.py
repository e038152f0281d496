"""The agent's only HTTP code: a typed client for the broker, standard library only.

One method per route the agent and the CLI call, the paths from
:mod:`breakpod.protocol`. One client holds one keep-alive connection and is not thread-safe: the
emitter's sender and poller threads and the CLI each have their own.
Failures become :class:`~breakpod._core.errors.BrokerRequestError` with a message a
person can act on.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from breakpod import protocol
from breakpod._core.config import AGENT_TOKEN_ENV, BROKER_TOKEN_ENV, BROKER_URL_ENV
from breakpod._core.errors import BrokerRequestError

ENV_URL = BROKER_URL_ENV
ENV_TOKEN = BROKER_TOKEN_ENV  # the CLI's; a job's agent reads AGENT_TOKEN_ENV
ENV_CA = "BREAKPOD_BROKER_CA"
STREAM_SILENCE = 30.0  # seconds without a byte, not even a keepalive, on an event stream
MAX_REPLY = 64 << 20  # bytes: the broker's largest page is far smaller; a stream is not it


class BrokerClient:
    def __init__(self, url: str, token: str | None, *, timeout: float = 10.0) -> None:
        bad = BrokerRequestError(f"broker URL {url!r} is not http(s)://HOST[:PORT]")
        try:
            parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
            port = parts.port  # raises on a port that is no number or out of range
            if parts.hostname:
                parts.hostname.encode("idna")  # raises on an empty or too long label
        except (ValueError, UnicodeError):
            raise bad from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.base = parts.path.rstrip("/")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, port
        self.token = _clean_token(token)
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    # -- the API, one method per route ------------------------------------------------

    def register(self, session_id: str, info: dict[str, Any]) -> Any:
        """Create or refresh the session (idempotent: also after the broker lost it)."""
        return self.request("PUT", protocol.session_path(_quoted(session_id)), info)

    def heartbeat(self, session_id: str, step: int | None = None) -> Any:
        """Keep the session alive; ``step``: the last training step, when counted."""
        body = {} if step is None else {protocol.HEARTBEAT_STEP: step}
        return self.request("POST", protocol.heartbeat_path(_quoted(session_id)), body)

    def post_events(self, body: bytes | dict[str, Any]) -> Any:
        """``{"events": [...]}``, or the same already encoded."""
        return self.request("POST", protocol.EVENTS, body)

    def poll(self, session_id: str, wait: float) -> list[dict[str, Any]]:
        """Commands for the session; the broker holds the call up to ``wait`` seconds."""
        reply = self.request("GET", f"{protocol.commands_path(_quoted(session_id))}?wait={wait:g}")
        return list(self._field(reply, "commands"))

    def ack(self, session_id: str, command_id: str, ok: bool, detail: str) -> Any:
        body = {"ok": ok, "detail": detail}
        path = protocol.ack_path(_quoted(session_id), _quoted(command_id))
        return self.request("POST", path, body)

    def send_command(self, session_id: str, command: dict[str, Any]) -> str:
        """Queue a command for a session; its id."""
        reply = self.request("POST", protocol.commands_path(_quoted(session_id)), command)
        return str(self._field(reply, "id"))

    def send_job_command(self, job: str, namespace: str | None, command: dict[str, Any]) -> str:
        """Queue one command for every session of a job in ``namespace``; its id."""
        body = {**command, "namespace": namespace}
        path = protocol.job_commands_path(_quoted(job))
        return str(self._field(self.request("POST", path, body), "id"))

    def session(self, session_id: str) -> dict[str, Any]:
        return dict(self._field(self.request("GET", protocol.session_path(_quoted(session_id)))))

    def sessions(self, *, limit: int = 1000, **filters: Any) -> list[dict[str, Any]]:
        """Every session the filters select (the broker applies them; ``None`` and empty
        ones are left out), page by page."""
        params = {"limit": limit, **{k: v for k, v in filters.items() if v}}
        found: list[dict[str, Any]] = []
        while True:
            page = self.request("GET", _with_query(protocol.SESSIONS, **params))
            found += self._field(page, "sessions")
            if not page.get("next"):  # an older broker sends one page without `next`
                return found
            params["cursor"] = page["next"]

    def events(self, **params: Any) -> list[dict[str, Any]]:
        """Recent events; ``params``: session, kind (a list repeats it), limit, since."""
        return list(
            self._field(self.request("GET", _with_query(protocol.EVENTS, **params)), "events")
        )

    def event_stream(self, **params: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        """New events as they come (see :meth:`stream`), filtered as :meth:`events`."""
        return self.stream(_with_query(protocol.EVENTS_STREAM, **params))

    def attach_info(self, session_id: str, local_port: int) -> dict[str, Any]:
        """How to reach the session's listener from here, forwarding to ``local_port``."""
        path = _with_query(protocol.attach_path(_quoted(session_id)), local_port=local_port)
        return dict(self._field(self.request("GET", path)))

    def whoami(self) -> dict[str, Any]:
        """Who the token is (any valid token may ask)."""
        reply = self.request("GET", protocol.WHOAMI)
        return reply if isinstance(reply, dict) else {}

    def healthz(self) -> Any:
        """The broker's health; needs no token."""
        return self.request("GET", protocol.HEALTHZ)

    # -- transport ----------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        """JSON in (or pre-encoded bytes), JSON out; one reconnect if a kept-alive
        connection went stale."""
        data = body if isinstance(body, bytes) or body is None else _encode(body)
        for attempt in (0, 1):
            try:
                response = self._send(method, path, data, timeout)
                payload = response.read(MAX_REPLY + 1)
                break
            except (OSError, http.client.HTTPException, UnicodeError) as e:
                self.close()
                if attempt or not isinstance(e, http.client.RemoteDisconnected | BrokenPipeError):
                    raise self._unreachable(e) from e
        if len(payload) > MAX_REPLY:
            self.close()
            raise BrokerRequestError(
                f"{self.url} sent a reply of more than {MAX_REPLY >> 20} MiB to {method} {path}: "
                f"is it the breakpod broker? Check --broker or ${ENV_URL}"
            )
        return self._decode(method, path, response.status, payload)

    def _field(self, reply: Any, key: str | None = None) -> Any:
        """``reply[key]`` (or the reply, a mapping), or an error naming who answered."""
        if isinstance(reply, dict) and (key is None or key in reply):
            return reply if key is None else reply[key]
        raise BrokerRequestError(
            f"{self.url} answered with something other than the breakpod broker's reply "
            f"({str(reply)[:80]!r}): check --broker or ${ENV_URL}"
        )

    def stream(self, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-Sent Events from ``path`` as (event kind, data), for good: when the
        broker ends a stream (its lifetime, a token re-check), it resumes where it
        left off with ``Last-Event-ID``; a revoked token ends it with a BrokerRequestError."""
        last_id: str | None = None
        resume = f"{path}{'&' if '?' in path else '?'}since={time.time():.3f}"  # none seen yet
        while True:
            for kind, data, event_id in self._stream_once(path, last_id):
                last_id = event_id or last_id
                yield kind, data
            time.sleep(0.5)  # the broker ended the stream: reconnect, gently
            path = path if last_id else resume

    def _stream_once(
        self, path: str, last_id: str | None
    ) -> Iterator[tuple[str, dict[str, Any], str | None]]:
        # the broker sends a keepalive every 2 s: silence this long means it is not there
        conn = self._connect(max(self.timeout, STREAM_SILENCE))
        headers = self._headers(None, sse=True)
        if last_id:
            headers["Last-Event-ID"] = last_id
        try:
            conn.request("GET", self.base + path, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                self._decode("GET", path, response.status, response.read())
            yield from _sse_events(response)
        except (OSError, http.client.HTTPException) as e:
            raise self._unreachable(e) from e
        finally:
            conn.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _send(
        self, method: str, path: str, data: bytes | None, timeout: float | None
    ) -> http.client.HTTPResponse:
        if self._conn is None:
            self._conn = self._connect(self.timeout)
        self._conn.timeout = timeout or self.timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(self._conn.timeout)
        self._conn.request(method, self.base + path, body=data, headers=self._headers(data))
        return self._conn.getresponse()

    def _connect(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._https:  # verified: the system's CAs, or $BREAKPOD_BROKER_CA
            context = _tls_context(os.environ.get(ENV_CA) or "")
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, data: bytes | None, *, sse: bool = False) -> dict[str, str]:
        headers = {"Accept": "text/event-stream" if sse else "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _unreachable(self, e: BaseException) -> BrokerRequestError:
        why = (
            "timed out"
            if isinstance(e, socket.timeout | TimeoutError)
            else str(e) or type(e).__name__
        )
        return BrokerRequestError(
            f"cannot reach the broker at {self.url} ({why}): is it running? "
            f"Set --broker or ${ENV_URL}"
        )

    def _decode(self, method: str, path: str, status: int, payload: bytes) -> Any:
        try:
            body = json.loads(payload) if payload else None
        except ValueError:
            body = payload.decode(errors="replace")[:200]
        if status < 300:
            return body
        raise BrokerRequestError(_explain(method, path, status, body, self.url), status)


def _quoted(name: str) -> str:
    """A session id or job name as one path segment (``#``, ``?``, ``/`` and non-ASCII
    escaped); an empty one is refused here, not routed to some other path."""
    if not name:
        raise BrokerRequestError(
            "an empty session id or job name: give one (see `breakpod sessions`)"
        )
    return urllib.parse.quote(name, safe="")


def _with_query(path: str, **params: Any) -> str:
    """``path?a=1&b=2``: ``None`` values left out, a list repeats its name."""
    pairs = [(k, v) for k, value in params.items() for v in _values(value)]
    query = urllib.parse.urlencode(pairs)
    return f"{path}?{query}" if query else path


def _values(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _encode(body: Any) -> bytes:
    return protocol.dumps(body).encode()


def _explain(method: str, path: str, status: int, body: Any, url: str) -> str:
    detail = body.get("message") or body.get("detail") if isinstance(body, dict) else body
    if status == 401:
        return (
            f"the broker at {url} refused the token ({detail}): set ${ENV_TOKEN} "
            f"(or --broker-token) for the CLI, ${AGENT_TOKEN_ENV} for a job"
        )
    if status == 403:
        return f"the token may not {method} {path}: {detail}"
    return f"broker: {method} {path} -> HTTP {status}: {detail}"


def _sse_events(
    response: http.client.HTTPResponse,
) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    kind, data, event_id = "message", "", None
    for raw in response:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield kind, json.loads(data), event_id
            kind, data, event_id = "message", "", None
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line.startswith("id:"):
            event_id = line[3:].strip()


def _tls_context(ca: str) -> ssl.SSLContext:
    """Verifying with ``ca``: a PEM file's path or the PEM text itself (as a
    ConfigMap reference puts it into the environment); empty: the system's CAs."""
    try:
        if ca.lstrip().startswith("-----BEGIN"):
            return ssl.create_default_context(cadata=ca)
        return ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as e:  # said as itself, not as a broker that is down
        shown = "the PEM text" if ca.lstrip().startswith("-----BEGIN") else repr(ca)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BrokerRequestError(
            f"{ENV_CA}={shown} cannot be read as a CA bundle ({why}): "
            "give the path of a PEM file, or the PEM text itself"
        ) from None


def _clean_token(token: str | None) -> str | None:
    """Tokens often come from files with a trailing newline; anything else is refused."""
    if token is None:
        return None
    token = token.strip()
    if not token.isprintable() or " " in token or not token.isascii():
        raise BrokerRequestError(
            "the broker token contains spaces, control characters or non-ASCII ones: check it"
        )
    return token or None
