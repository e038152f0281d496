"""A small HTTP client for the broker, on the standard library only.

One client holds one keep-alive connection and is not thread-safe: the
emitter's sender and poller threads and the CLI each have their own.
Failures become :class:`~breakpod.errors.BrokerError` with a message a
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

from breakpod.config import BROKER_URL_ENV, ENV
from breakpod.errors import BrokerError

ENV_URL = BROKER_URL_ENV
ENV_TOKEN = ENV["token"]
ENV_CA = "BREAKPOD_BROKER_CA"


class BrokerClient:
    def __init__(self, url: str, token: str | None, *, timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BrokerError(f"broker URL {url!r} is not http(s)://HOST[:PORT]")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.base = parts.path.rstrip("/")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self.token = _clean_token(token)
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        """JSON in (or pre-encoded bytes), JSON out; one reconnect if a kept-alive
        connection went stale."""
        data = body if isinstance(body, bytes) or body is None else _encode(body)
        for attempt in (0, 1):
            try:
                response = self._send(method, path, data, timeout)
                payload = response.read()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt or not isinstance(e, http.client.RemoteDisconnected | BrokenPipeError):
                    raise self._unreachable(e) from e
        return self._decode(method, path, response.status, payload)

    def stream(self, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-Sent Events from ``path`` as (event kind, data), for good: when the
        broker ends a stream (its lifetime, a token re-check), it resumes where it
        left off with ``Last-Event-ID``; a revoked token ends it with a BrokerError."""
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
        conn = self._connect(None)
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

    def _unreachable(self, e: BaseException) -> BrokerError:
        why = (
            "timed out"
            if isinstance(e, socket.timeout | TimeoutError)
            else str(e) or type(e).__name__
        )
        return BrokerError(
            f"cannot reach the broker at {self.url} ({why}): is it running? "
            f"Set --broker or ${ENV_URL}"
        )

    def _decode(self, method: str, path: str, status: int, payload: bytes) -> Any:
        try:
            body = json.loads(payload) if payload else None
        except ValueError:
            body = payload.decode(errors="replace")[:200]
        if status < 400:
            return body
        raise BrokerError(_explain(method, path, status, body, self.url), status)


def _encode(body: Any) -> bytes:
    return json.dumps(body, default=str).encode()


def _explain(method: str, path: str, status: int, body: Any, url: str) -> str:
    detail = body.get("message") or body.get("detail") if isinstance(body, dict) else body
    if status == 401:
        return f"the broker at {url} refused the token ({detail}): set --token or ${ENV_TOKEN}"
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
    if ca.lstrip().startswith("-----BEGIN"):
        return ssl.create_default_context(cadata=ca)
    return ssl.create_default_context(cafile=ca or None)


def _clean_token(token: str | None) -> str | None:
    """Tokens often come from files with a trailing newline; anything else is refused."""
    if token is None:
        return None
    token = token.strip()
    if not token.isprintable() or " " in token:
        raise BrokerError("the broker token contains spaces or control characters: check it")
    return token or None
