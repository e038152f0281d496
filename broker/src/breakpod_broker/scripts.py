"""The Lua scripts the broker runs in Redis, each one atomic across replicas.

Loaded once per client with ``register_script``: calls send the script's SHA
(EVALSHA), and redis-py loads the text again when Redis answers NOSCRIPT (a
restarted or replaced server). In a pipeline, :func:`pipelined` does the same
(redis-py's own way asks ``SCRIPT EXISTS`` first, a round trip of its own on
every execute).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from breakpod import protocol

# Final states are sticky: once a session reads finished, failed or killed, no later
# non-final event or heartbeat (a stale one, delivered after an outage) reopens it.
# The first final event that says how the process ended (an exit status, a signal,
# the runtime's reason) settles it (the hash's "settled" field): later final words
# are stored as events but change nothing (protocol.final_state says why).
_FINAL = (
    "local finals = {"
    + ", ".join(f"['{state}'] = true" for state in sorted(protocol.FINAL_STATES))
    + "}\n"
)


# Session fields that hold while its state does: a park's deadline, who is attached,
# a stall's culprit (stalls.py), since when (set on each change of state).
STATE_EXTRAS = ("hold_until", "attached_by", "culprit", "since")
_EXTRAS = ", ".join(f"'{name}'" for name in STATE_EXTRAS)


def _state_changes(session_hash: str, first: str) -> str:
    """Lua: apply the state changes from ARGV[first] on (index, state, reason, address,
    listener, settles, extras) for events that were stored; final stays final (see
    above). ``extras``: JSON of the fields that hold while the state does (a park's
    hold deadline, who is attached); a change to another state drops the old ones."""
    return f"""
local live = redis.call('EXISTS', {session_hash}) == 1
local ended = live and finals[redis.call('HGET', {session_hash}, 'state')] == true
local settled = live and redis.call('HEXISTS', {session_hash}, 'settled') == 1
for b = {first}, #ARGV - 1, 7 do
  if live and out[tonumber(ARGV[b])] ~= '' then
    local state = ARGV[b + 1]
    if state ~= '' and not settled and (not ended or finals[state]) then
      if redis.call('HGET', {session_hash}, 'state') ~= state then
        redis.call('HDEL', {session_hash}, {_EXTRAS})
        local t = redis.call('TIME')
        redis.call('HSET', {session_hash}, 'since', t[1] .. '.' .. string.format('%06d', t[2]))
      end
      redis.call('HSET', {session_hash}, 'state', state, 'reason', ARGV[b + 2])
      for k, v in pairs(cjson.decode(ARGV[b + 6])) do
        redis.call('HSET', {session_hash}, k, tostring(v))
      end
      ended = finals[state] == true
      if ARGV[b + 5] ~= '' then
        redis.call('HSET', {session_hash}, 'settled', '1')
        settled = true
      end
    end
    if ARGV[b + 3] ~= '' and not ended then
      redis.call('HSET', {session_hash}, 'address', ARGV[b + 3], 'listener', ARGV[b + 4])
    end
  end
end"""


# KEYS: session hash, alive key, then the session indexes (all, its namespace's,
# its job's): each scores the session by its first registration. With Redis
# Cluster only the first two (one slot): the caller then adds the session to the
# indexes itself, with the score returned. ARGV: token id, namespace ("" for
# none), now, retention, heartbeat ttl, session id, n fields to clear, the n
# names, then field/value pairs. Returns "+CREATED" when written, else (nothing
# written) "owner" when another token registered the session, or "namespace:NS"
# when it was registered in another namespace NS. Owner and namespace never
# change once set, whoever asks; one script, so two registrants of one new id
# get one owner.
REGISTER_LUA = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return 'owner' end
if owner then
  local ns = redis.call('HGET', KEYS[1], 'namespace') or ''
  if ns ~= ARGV[2] then return 'namespace:' .. ns end
end
local n = tonumber(ARGV[7])
redis.call('HSETNX', KEYS[1], 'created', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
redis.call('HDEL', KEYS[1], 'settled')  -- a registration starts the session's life anew
if n > 0 then redis.call('HDEL', KEYS[1], unpack(ARGV, 8, 7 + n)) end
if #ARGV > 7 + n then redis.call('HSET', KEYS[1], unpack(ARGV, 8 + n)) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[5])
local created = redis.call('HGET', KEYS[1], 'created')
for i = 3, #KEYS do redis.call('ZADD', KEYS[i], created, ARGV[6]) end
return '+' .. created
"""

# KEYS: session hash, alive key, and (but with Redis Cluster) the deadlines
# (keys.DEADLINES). ARGV: token id, now, retention, heartbeat ttl, session id,
# then field/value pairs to set. The whole heartbeat, O(1): returns {'missing'},
# {'owner', namespace} (another token's session: nothing written), or {'ok',
# then the hash's field/value pairs as written}. An ended session keeps its
# state and reason.
HEARTBEAT_LUA = (
    _FINAL
    + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return {'missing'} end
if owner ~= ARGV[1] then return {'owner', redis.call('HGET', KEYS[1], 'namespace') or ''} end
local ended = finals[redis.call('HGET', KEYS[1], 'state')] == true
local fields = {'last_seen', ARGV[2]}
for i = 6, #ARGV - 1, 2 do
  if not (ended and (ARGV[i] == 'state' or ARGV[i] == 'reason')) then
    table.insert(fields, ARGV[i])
    table.insert(fields, ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
if KEYS[3] then redis.call('ZADD', KEYS[3], tonumber(ARGV[2]) + tonumber(ARGV[4]), ARGV[5]) end
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 'ok')
return out
"""
)

# KEYS: session hashes. ARGV: their ids. Drops from the index only ids whose
# hash is still gone (another replica may have re-registered one meanwhile).
PRUNE_LUA = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then redis.call('ZREM', ARGV[#ARGV], ARGV[i]) end
end
return 0
"""

# KEYS: global stream, session stream, session hash.
# ARGV: global maxlen, session maxlen, dedup ttl, retention, seen-key prefix, n,
#       n x (event id, document), then per state change: index, state, reason,
#       address, listener. Returns the cursors joined by "," ("" = duplicate):
#       one bulk reply and two arguments per event keep redis-py's share small.
# A session hash that expired meanwhile is not recreated (without TTL or owner).
# An ended session's address no longer changes, and its state and reason only by
# a final event that settles it after an earlier final word that did not.
INGEST_LUA = (
    _FINAL
    + """
local n = tonumber(ARGV[6])
local out = {}
for i = 1, n do
  if redis.call('SET', ARGV[5] .. ARGV[5 + 2 * i], '1', 'NX', 'EX', ARGV[3]) then
    local sid = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'event', ARGV[6 + 2 * i])
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], sid, 'event', ARGV[6 + 2 * i])
    out[i] = sid
  else
    out[i] = ''
  end
end
"""
    + _state_changes("KEYS[3]", "7 + 2 * n")
    + """
redis.call('EXPIRE', KEYS[2], ARGV[4])
if live then redis.call('EXPIRE', KEYS[3], ARGV[4]) end
return table.concat(out, ',')
"""
)


# Redis Cluster: the per-session half of INGEST_LUA (one slot); the broker has
# appended the new events to the global stream first and passes their ids, so
# both streams hold each event under one cursor.
# KEYS: session stream, session hash. ARGV: session maxlen, dedup ttl, retention,
# seen-key prefix, n, n x (event id, document, global cursor), then the state
# changes as in INGEST_LUA. Returns the cursors joined by "," ("" = duplicate:
# the caller deletes its global copy). A cursor not above the session stream's
# last (two requests for one session crossed) is replaced by a new one there.
INGEST_SESSION_LUA = (
    _FINAL
    + """
local n = tonumber(ARGV[5])
local out = {}
for i = 1, n do
  local at = 3 + 3 * i
  if redis.call('SET', ARGV[4] .. ARGV[at], '1', 'NX', 'EX', ARGV[2]) then
    local doc = ARGV[at + 1]
    local ok = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], ARGV[at + 2], 'event', doc)
    if type(ok) == 'table' and ok.err then
      redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'event', doc)
    end
    out[i] = ARGV[at + 2]
  else
    out[i] = ''
  end
end
"""
    + _state_changes("KEYS[2]", "6 + 3 * n")
    + """
redis.call('EXPIRE', KEYS[1], ARGV[3])
if live then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
return table.concat(out, ',')
"""
)


# KEYS: session hash. ARGV: cursor field, the stream id of an acknowledged job
# command. Moves the session's job cursor forward to it, never back, and never
# creates the hash (an expired session stays expired). Returns 1 when moved.
ADVANCE_JOB_CURSOR_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local a, b = string.match(cur, '^(%d+)-(%d+)$')
local c, d = string.match(ARGV[2], '^(%d+)-(%d+)$')
a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
if c > a or (c == a and d > b) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return 1
end
return 0
"""


# KEYS: n session hashes, then their n alive keys. ARGV: n, final states (joined
# by ","), lost,
# initial state, namespace filter ('' none, else '=' .. namespace), job filter
# (the same), then the visible namespaces ('*' alone: all). Counts the sessions
# the filters select per state (lost when the alive key is gone and not final),
# in Redis: the broker parses one short reply per chunk, not two per session.
COUNT_LUA = """
local n = tonumber(ARGV[1])
local finals, lost, initial = {}, ARGV[3], ARGV[4]
for state in string.gmatch(ARGV[2], '[^,]+') do finals[state] = true end
local ns_f, job_f = ARGV[5], ARGV[6]
local visible = nil
if ARGV[7] ~= '*' then
  visible = {}
  for i = 7, #ARGV do visible[ARGV[i]] = true end
end
local counts = {}
for i = 1, n do
  local f = redis.call('HMGET', KEYS[i], 'state', 'namespace', 'job', 'owner')
  if f[4] then
    local ns = f[2] or ''
    if (not visible or visible[ns]) and (ns_f == '' or ns_f == '=' .. ns)
        and (job_f == '' or job_f == '=' .. (f[3] or '')) then
      local state = f[1] or initial
      if not finals[state] and redis.call('EXISTS', KEYS[n + i]) == 0 then state = lost end
      counts[state] = (counts[state] or 0) + 1
    end
  end
end
local out = {}
for k, v in pairs(counts) do
  table.insert(out, k)
  table.insert(out, v)
end
return out
"""


@dataclasses.dataclass(frozen=True)
class Scripts:
    """The scripts, registered with one client (call them with ``client=pipe`` in a pipeline)."""

    register: Any
    prune: Any
    ingest: Any
    heartbeat: Any
    ingest_session: Any
    advance_job_cursor: Any
    count: Any

    @classmethod
    def register_with(cls, redis: Any) -> Scripts:
        return cls(
            redis.register_script(REGISTER_LUA),
            redis.register_script(PRUNE_LUA),
            redis.register_script(INGEST_LUA),
            redis.register_script(HEARTBEAT_LUA),
            redis.register_script(INGEST_SESSION_LUA),
            redis.register_script(ADVANCE_JOB_CURSOR_LUA),
            redis.register_script(COUNT_LUA),
        )


async def pipelined(
    redis: Any, script: Any, calls: Sequence[tuple[list[str], list[Any]]]
) -> list[Any]:
    """``script`` once per ``(keys, args)`` in one pipeline, by SHA; when Redis forgot the
    script (NOSCRIPT: none of the calls ran), it is loaded and the pipeline runs again."""
    try:
        return await _evalsha_each(redis, script.sha, calls)
    except NoScriptError:
        script.sha = await redis.script_load(script.script)
        return await _evalsha_each(redis, script.sha, calls)


async def _evalsha_each(
    redis: Any, sha: str, calls: Sequence[tuple[list[str], list[Any]]]
) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for call_keys, args in calls:
            pipe.evalsha(sha, len(call_keys), *call_keys, *args)
        return list(await pipe.execute())
