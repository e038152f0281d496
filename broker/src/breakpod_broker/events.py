"""Events: ingested in batches, stored in Redis Streams, queried, and streamed over SSE.

Each event lands in the global stream and in its session's stream under the
same stream id (the *cursor*), once: the agent picks the event id, and a
retry with an id already seen inside ``dedup_seconds`` is dropped. Events
that say a session changed state (parked, attached, resumed, ...) update the
session in the same Lua call, so replicas never disagree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from breakpod import protocol
from breakpod.protocol import EventKind
from breakpod_broker import fanout, keys, scripts, sharded, stalls
from breakpod_broker.auth import Agent, Credentials, Viewer, recheck
from breakpod_broker.context import Broker, BrokerDep
from breakpod_broker.limits import (
    MAX_DEPTH,
    MAX_FIELDS_BYTES,
    as_text,
    dotted,
    lone_surrogate,
    nonfinite,
    too_deep,
)
from breakpod_broker.models import (
    EventBatch,
    EventIn,
    EventOut,
    EventPage,
    IngestResult,
    SessionOut,
)
from breakpod_broker.sessions import check_owner, read_many
from breakpod_broker.tokens import Principal

try:
    import orjson
except ImportError:  # optional: json.dumps then
    orjson = None  # type: ignore[assignment]

router = APIRouter(tags=["events"])
log = logging.getLogger(__name__)
SSE_BLOCK_MS = 2000  # also the keepalive period of an idle stream
TOKEN_RECHECK_SECONDS = 2.0  # an SSE stream ends this long (+ one block) after revocation
SCAN_CHUNK = 1000
SCAN_CHUNKS = 10  # a query reads at most SCAN_CHUNK * SCAN_CHUNKS entries
MAX_ID = 2**64 - 1
CURSOR = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")  # ASCII: \d and int() take any script's digits
SECONDS = re.compile(r"^[0-9]{1,11}(\.[0-9]*)?$")  # float() takes 1_7, 1e9, ' 1', '١٧'
ADDRESS = re.compile(protocol.ADDRESS_PATTERN)


@router.post(protocol.EVENTS, response_model=IngestResult)
async def post_events(
    batch: EventBatch, who: Agent, broker: BrokerDep, request: Request
) -> IngestResult:
    """Store a batch of events; an agent token may write only its own sessions' events.
    (fastpath.py serves the common case of this route below FastAPI, the same way.)"""
    raw = await request.body()  # kept by the body parser
    return await accept(broker, who, batch, plain=plain_numbers(raw))


async def accept(broker: Broker, who: Principal, batch: EventBatch, *, plain: bool) -> IngestResult:
    """The route's work once the batch is valid and ``who`` is an agent (or admin):
    413 for too many events, 404/403 for a session it may not write, 422 from
    :func:`ingest`. ``plain``: :func:`plain_numbers` of the request's body."""
    most = broker.settings.max_batch
    if len(batch.events) > most:
        raise HTTPException(413, f"{len(batch.events)} events in one batch: send at most {most}")
    sessions = await _sessions_for(broker, who, {e.session for e in batch.events})
    return await ingest(broker, batch.events, sessions, plain=plain)


# Numbers orjson would not carry as the strict path does: an integer past 63 bits (a run
# of 19 digits; orjson refuses to write one past 64 bits) and a 3-digit exponent (past
# float64 it reads as an infinity, which orjson writes as null and the strict path
# refuses). A float needs no care: both write its shortest form, at most 17 digits.
# False alarms (a long number in a string) cost only the strict path's speed. Searched
# for with every digit written as 0, E as e and + as -: one translate and three
# substring searches (a regex took a quarter of a busy replica's CPU). A JSON exponent
# always follows a digit.
_NUMBER_SHAPES = bytes.maketrans(b"123456789E+", b"000000000e-")
_UNUSUAL_SHAPES = (b"0" * 19, b"0e000", b"0e-000")


def plain_numbers(raw: bytes) -> bool:
    """May orjson read and write this body's numbers as the strict path would? No NaN or
    infinity tokens, no number past float64 or 64-bit integers (nor any look-alike)."""
    if b"NaN" in raw or b"Infinity" in raw:
        return False
    shapes = raw.translate(_NUMBER_SHAPES)
    return not any(shape in shapes for shape in _UNUSUAL_SHAPES)


async def _sessions_for(broker: Broker, who: Principal, ids: set[str]) -> dict[str, SessionOut]:
    ordered = sorted(ids)
    found = dict(zip(ordered, await read_many(broker, ordered), strict=True))
    for session_id, session in found.items():
        if session is None or not who.may_see(session.namespace):
            raise HTTPException(
                404,
                f"no session {session_id!r}: register it first "
                f"(PUT {protocol.session_path(session_id)})",
            )
        check_owner(who, session_id, session.owner)
    return {k: v for k, v in found.items() if v is not None}


async def ingest(
    broker: Broker,
    events: list[EventIn],
    sessions: dict[str, SessionOut],
    *,
    plain: bool = False,
) -> IngestResult:
    """Store events (deduplicated), update session states, then notify; in batch order.
    ``plain``: :func:`plain_numbers` of the request, so the fast encoder may write it."""
    now = time.time()
    docs = [_document(e, sessions[e.session], now) for e in events]
    dumps = _fast_dumps if plain and orjson is not None else _dumps
    encoded = [dumps(doc, i) for i, doc in enumerate(docs)]
    by_session: dict[str, list[int]] = {}
    for i, event in enumerate(events):
        by_session.setdefault(event.session, []).append(i)
    cursors: list[str | None] = [None] * len(events)
    started = time.perf_counter()
    if broker.cluster:
        replies = await sharded.ingest(
            broker,
            by_session,
            events,
            encoded,
            lambda sid, ix, cursors: _session_lua_args(broker, events, encoded, ix, cursors),
        )
    else:
        calls = [
            (_lua_keys(session_id), _lua_args(broker, session_id, events, encoded, indexes))
            for session_id, indexes in by_session.items()
        ]
        replies = await scripts.pipelined(broker.redis, broker.scripts.ingest, calls)
    broker.metrics.redis_latency.labels("ingest").observe(time.perf_counter() - started)
    for indexes, reply in zip(by_session.values(), replies, strict=True):
        for i, cursor in zip(indexes, reply.split(","), strict=True):
            cursors[i] = cursor or None
    accepted = [{**d, "cursor": c} for d, c in zip(docs, cursors, strict=True) if c is not None]
    broker.metrics.ingested(accepted, duplicates=len(events) - len(accepted))
    await stalls.blame(broker, accepted, sessions)
    await broker.notifiers.enqueue(accepted, sessions)
    return IngestResult(
        accepted=len(accepted), duplicates=len(events) - len(accepted), cursors=cursors
    )


def _document(event: EventIn, session: SessionOut, now: float) -> dict[str, Any]:
    """The stored form (built by hand: model_dump costs 3x on the ingest path)."""
    return {
        "id": event.id,
        "session": event.session,
        "kind": event.kind,
        "time": event.time or now,
        "fields": event.fields,
        "received": now,
        "namespace": session.namespace,
    }


def _lua_keys(session_id: str) -> list[str]:
    return [keys.EVENTS, keys.session_events(session_id), keys.session(session_id)]


def _lua_args(
    broker: Broker,
    session_id: str,
    events: list[EventIn],
    encoded: list[str],
    indexes: list[int],
) -> list[Any]:
    s = broker.settings
    args: list[Any] = [s.global_stream_maxlen, s.session_stream_maxlen, s.dedup_seconds]
    args += [s.retention_seconds, keys.seen(session_id, ""), len(indexes)]
    for i in indexes:
        args += [events[i].id, encoded[i]]
    return args + _changes(events, indexes)


def _session_lua_args(
    broker: Broker,
    events: list[EventIn],
    encoded: list[str],
    indexes: list[int],
    cursors: dict[int, str],
) -> list[Any]:
    """INGEST_SESSION_LUA's arguments (Redis Cluster): as _lua_args, with each
    event's cursor in the global stream."""
    s = broker.settings
    session_id = events[indexes[0]].session
    args: list[Any] = [s.session_stream_maxlen, s.dedup_seconds, s.retention_seconds]
    args += [keys.seen(session_id, ""), len(indexes)]
    for i in indexes:
        args += [events[i].id, encoded[i], cursors[i]]
    return args + _changes(events, indexes)


def _changes(events: list[EventIn], indexes: list[int]) -> list[Any]:
    """Per event that changes its session: its place in the call, state, reason,
    listener address and backend, and "1" when it settles how the session ended."""
    changes: list[Any] = []
    for n, i in enumerate(indexes, start=1):
        event = events[i]
        state = protocol.STATE_OF_KIND.get(event.kind, "")
        address, backend = _listener(event)
        settled = ""
        if ended := protocol.final_state(event.kind, event.fields):
            state, reason, settles = ended
            settled = "1" if settles else ""
        else:
            reason = _reason(event) if state else ""
        if state or address:
            changes += [n, state, reason[:2000], address, backend, settled, _extras(event)]
    return changes


def _extras(event: EventIn) -> str:
    """JSON of the session fields that hold while the event's state does."""
    fields, extras = event.fields, {}
    hold = fields.get(protocol.HOLD_UNTIL_FIELD)
    if isinstance(hold, (int, float)) and not isinstance(hold, bool) and 0 < hold < 1e11:
        extras["hold_until"] = repr(float(hold))
    seconds = fields.get("seconds")
    if event.kind == protocol.STALL and isinstance(seconds, (int, float)) and seconds >= 0:
        extras["since"] = repr((event.time or time.time()) - float(seconds))  # the last step
    client = fields.get(protocol.CLIENT_FIELD)
    if event.kind == protocol.ATTACHED and isinstance(client, str) and client:
        extras["attached_by"] = client[:200]
    return json.dumps(extras)


def _reason(event: EventIn) -> str:
    """The session's new reason: what the event says (a rank's stall: where it is)."""
    fields = event.fields
    said = str(fields.get("reason") or fields.get("why") or "")
    if said or event.kind != protocol.STALL:
        return said
    return stall_reason(fields)


def stall_reason(fields: dict[str, Any]) -> str:
    """A stall event's reason, from what it says: how long, where, doing what."""
    seconds = fields.get("seconds")
    parts = [f"no step for {seconds}s" if isinstance(seconds, (int, float)) else "no step"]
    if isinstance(fields.get("step"), int):
        parts.append(f"at step {fields['step']}")
    if fields.get("frame"):
        parts.append(f"in {fields['frame']}")
    if fields.get("state"):
        parts.append(f"({fields['state']})")
    return " ".join(parts)


def _dumps(doc: dict[str, Any], index: int) -> str:
    """Strict JSON. 422 for a NaN or infinity (walked for only then: walking every
    event's fields would slow ingest down) or fields over MAX_FIELDS_BYTES."""
    try:
        text = json.dumps(doc, default=str, allow_nan=False)
    except ValueError:
        path = dotted(nonfinite(doc["fields"]) or [])
        raise HTTPException(
            422,
            f"events.{index}.fields.{path}: NaN and infinities are not JSON: "
            'send them as the strings "nan", "inf", "-inf"',
        ) from None
    # text escapes each non-ASCII character and spaces its separators: never shorter
    # than the fields as compact UTF-8, the size the limit counts whatever the encoder
    if len(text) > MAX_FIELDS_BYTES and _fields_bytes(doc) > MAX_FIELDS_BYTES:
        raise HTTPException(
            422,
            f"events.{index}.fields: more than {MAX_FIELDS_BYTES} bytes of JSON: "
            "send less (e.g. a summary, or a path to a file)",
        )
    return text


def _fast_dumps(doc: dict[str, Any], index: int) -> str:
    """orjson (~5x json.dumps) for a request without NaN or infinities; same size limit."""
    assert orjson is not None
    encoded = orjson.dumps(doc, default=str)  # compact UTF-8
    if len(encoded) > MAX_FIELDS_BYTES:
        return _dumps(doc, index)  # the exact check and its message
    return encoded.decode()


def _fields_bytes(doc: dict[str, Any]) -> int:
    """The size of the event's fields as compact UTF-8 JSON."""
    compact = json.dumps(doc["fields"], default=str, ensure_ascii=False, separators=(",", ":"))
    return len(compact.encode())


def _listener(event: EventIn) -> tuple[str, str]:
    """(address, backend) when the event announces a listener, else ("", "")."""
    fields = event.fields
    address, backend = fields.get("address"), fields.get("backend", protocol.DEFAULT_LISTENER)
    if event.kind not in protocol.LISTENER_KINDS or not isinstance(address, str):
        return "", ""
    if not ADDRESS.match(address) or backend not in protocol.LISTENERS:
        return "", ""
    return address, backend


class Filters:
    """Query filters shared by the page and the live stream."""

    def __init__(
        self,
        session: Annotated[str | None, Query(pattern=protocol.SESSION_ID_PATTERN)] = None,
        kind: Annotated[list[EventKind] | None, Query()] = None,
    ) -> None:
        self.session = session
        self.kinds = set(kind or ())

    @property
    def stream(self) -> str:
        return keys.session_events(self.session) if self.session else keys.EVENTS

    def needles(self, who: Principal) -> list[list[str]]:
        """Groups of texts; a stored event can match only if it holds one of each group."""
        groups = [[t for k in sorted(self.kinds) for t in _both("kind", k)]] if self.kinds else []
        if who.namespaces is not None:  # may_see: "" stands for events without a namespace
            groups.append([t for n in who.namespaces for t in _both("namespace", n or None)])
        return groups

    def match_everything(self, who: Principal) -> bool:
        """Would :meth:`match`, and the session filter, let every event through?"""
        return self.session is None and not self.kinds and who.namespaces is None

    def match(self, who: Principal, doc: dict[str, Any]) -> bool:
        return (not self.kinds or doc.get("kind") in self.kinds) and who.may_see(
            doc.get("namespace")
        )


def _both(name: str, value: Any) -> list[str]:
    """The texts json.dumps and orjson (compact) write for one key and value."""
    return [f'"{name}": {json.dumps(value)}', f'"{name}":{json.dumps(value)}']


Since = Annotated[
    str | None,
    Query(max_length=64, description="a cursor (after it) or unix seconds (from then on)"),
]


@router.get(protocol.EVENTS, response_model=EventPage)
async def list_events(
    who: Viewer,
    broker: BrokerDep,
    filters: Annotated[Filters, Depends()],
    since: Since = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    """Events, oldest first: after ``since``, or the latest ``limit`` without it."""
    if since is None:
        found = await _scan(broker, who, filters, limit, newest_first=True)
        found.reverse()
    else:
        found = await _scan(broker, who, filters, limit, start=parse_since(since))
    return EventPage(
        events=[e for e in map(_readable, found) if e is not None],
        cursor=found[-1]["cursor"] if found else since,
    )


def _readable(doc: dict[str, Any]) -> EventOut | None:
    """The stored event as the API shows it, or None (logged) when it is not one
    this broker could have written: a bad record is skipped, never a failed read."""
    try:
        return EventOut.model_validate(doc)
    except ValidationError as e:
        log.warning("event %s: stored record is invalid, skipped: %s", doc.get("cursor"), e)
        return None


async def _scan(
    broker: Broker,
    who: Principal,
    filters: Filters,
    limit: int,
    *,
    start: str = "-",
    newest_first: bool = False,
) -> list[dict[str, Any]]:
    """Walk the stream in chunks until ``limit`` matches (at most SCAN_CHUNKS chunks),
    decoding in a worker thread so other requests go on meanwhile."""
    found: list[dict[str, Any]] = []
    position = "+" if newest_first else start
    for _ in range(SCAN_CHUNKS):
        if newest_first:
            chunk = await broker.redis.xrevrange(filters.stream, position, "-", count=SCAN_CHUNK)
        else:
            chunk = await broker.redis.xrange(filters.stream, position, "+", count=SCAN_CHUNK)
        found += await asyncio.to_thread(_matching, chunk, filters, who)
        if len(chunk) < SCAN_CHUNK or len(found) >= limit:
            break
        position = "(" + chunk[-1][0]
    return found[:limit]


def _matching(
    chunk: list[tuple[str, dict[str, str]]], filters: Filters, who: Principal
) -> list[dict[str, Any]]:
    """The chunk's entries that pass the filters; entries whose stored text cannot
    match (json.dumps wrote it, so the needles are exact) are not decoded at all."""
    needles = filters.needles(who)
    return [
        doc
        for cursor, fields in chunk
        if all(any(n in fields.get("event", "") for n in group) for group in needles)
        and (doc := _decode(cursor, fields)) is not None
        and filters.match(who, doc)
    ]


def _decode(cursor: str, fields: dict[str, str]) -> dict[str, Any] | None:
    """The stored document, or None (logged) when the record cannot be one: a
    stored event never makes a read fail."""
    raw = fields.get("event", "")
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError) as e:
        log.warning("event %s: stored record is not JSON, skipped: %s", cursor, e)
        return None
    path = too_deep(doc, MAX_DEPTH + 1) if isinstance(doc, dict) else []
    if path is not None or not isinstance(doc.get("fields"), dict):
        log.warning("event %s: stored record is not an event (or too deep), skipped", cursor)
        return None
    if "NaN" in raw or "Infinity" in raw:  # stored before ingest normalised them
        doc = protocol.finite(doc)
    if ("\\ud" in raw or "\\uD" in raw) and lone_surrogate(doc) is not None:
        doc = as_text(doc)  # stored before requests were checked for them
    doc["cursor"] = cursor
    return dict(doc)


def is_cursor(text: str) -> bool:
    return bool(CURSOR.match(text)) and all(int(part) <= MAX_ID for part in text.split("-"))


def parse_since(since: str) -> str:
    """A cursor means "after it"; a number of unix seconds means "from then on"."""
    if is_cursor(since) and since != f"{MAX_ID}-{MAX_ID}":  # nothing is after the last id
        return "(" + since
    seconds = float(since) if SECONDS.match(since) else -1.0
    if not 0 <= seconds < 1e11:
        raise HTTPException(
            422, f"since={since!r} is neither a cursor (e.g. 1700000000000-0) nor unix seconds"
        )
    return f"{int(seconds * 1000)}-0"


@router.get(
    protocol.EVENTS_STREAM,
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def stream_events(
    who: Viewer,
    request: Request,
    credentials: Credentials,
    broker: BrokerDep,
    filters: Annotated[Filters, Depends()],
    since: Since = None,
    last_event_id: Annotated[str | None, Header(max_length=64)] = None,
) -> StreamingResponse:
    """Server-Sent Events as they arrive (from any replica); resumes at Last-Event-ID.

    A stream ends when its token is revoked (checked every few seconds) and after
    ``max_stream_seconds``; clients reconnect with Last-Event-ID and lose nothing."""
    broker.room_to_follow()
    resume = last_event_id if last_event_id and is_cursor(last_event_id) else since
    start = (
        parse_since(resume).lstrip("(") if resume else await _last_cursor(broker, filters.stream)
    )
    if resume and not is_cursor(resume):  # seconds: include that millisecond
        start = _before(start)
    body = _follow(broker, Watch(who, recheck(request, credentials, broker), filters), start)
    return fanout.SSEResponse(body, broker.settings.stream_stall_seconds)


async def _last_cursor(broker: Broker, stream: str) -> str:
    last = await broker.redis.xrevrange(stream, "+", "-", count=1)
    return str(last[0][0]) if last else "0-0"


def _before(cursor: str) -> str:
    ms = int(cursor.split("-")[0])
    return f"{max(ms - 1, 0)}-{MAX_ID if ms else 0}"


@dataclasses.dataclass
class Watch:
    """Who reads an SSE stream, how to ask again who its credentials are, and what they
    asked for."""

    who: Principal
    now: Callable[[], Awaitable[Principal | None]]
    filters: Filters


def _follow(broker: Broker, watch: Watch, start: str) -> AsyncIterator[str]:
    """The stream's body: the replica's fan-out, after a catch-up from Redis."""
    filters, who = watch.filters, watch.who

    def matches(doc: dict[str, Any]) -> bool:
        return (filters.session in (None, doc.get("session"))) and filters.match(who, doc)

    wants = None if filters.match_everything(who) else matches  # None: no call per event

    async def catch_up(after: str) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
        chunk = await broker.redis.xrange(filters.stream, "(" + after, "+", count=SCAN_CHUNK)
        found = [(d["cursor"], d) for d in _matching(chunk, filters, who)]
        return found, (chunk[-1][0] if len(chunk) == SCAN_CHUNK else None)

    async def still_allowed() -> bool:
        return await watch.now() == who

    async def body() -> AsyncIterator[str]:
        assert broker.fanout is not None  # started with the app
        with broker.fanout.follow(who.namespaces, wants) as follower:
            async for text in fanout.stream(
                broker.fanout,
                follower,
                catch_up,
                start,
                still_allowed,
                max_seconds=broker.settings.max_stream_seconds,
                recheck_seconds=TOKEN_RECHECK_SECONDS,
            ):
                yield text

    return body()
