"""Every Redis key the broker uses, with its lifetime (as arq's constants.py).

All state lives here, so any number of broker replicas can share one Redis.

Hash tags: a session's keys carry ``{SESSION_ID}`` and a job's index ``{JOB}``,
so in a Redis Cluster each session's keys (and each job's) share one slot and
the per-session Lua scripts touch one slot's keys (but for the global stream and
index, see the README's Redis Cluster note).
"""

from __future__ import annotations

PREFIX = "breakpod:"

# Sorted set: session id -> time of its first registration (newest first when
# listed; heartbeats leave it alone, so pages stay stable). No TTL; members
# whose session hash has expired are pruned when listed. namespace_sessions and
# job_sessions below are the same index narrowed to one namespace or one job.
SESSIONS = PREFIX + "sessions"

# Sorted set: session id -> unix seconds at which its alive key expires (each beat,
# poll and registration moves it on). Swept by every replica (deaths.py): an entry
# past its deadline is claimed by exactly one replica, which records the death. No
# TTL; an entry leaves when claimed.
DEADLINES = PREFIX + "deadlines"

# Stream of every event, trimmed to settings.global_stream_maxlen (MAXLEN ~).
EVENTS = PREFIX + "events"

# Hash: token digest -> JSON {role, namespaces, name}, tokens made by admins
# through the API (static ones come from settings). No TTL: deleted explicitly.
TOKENS = PREFIX + "tokens"

# Stream of notifier jobs, one per (notifier, event), read by the consumer group
# "notifiers" of all replicas; an entry is deleted once delivered or given up.
NOTIFY = PREFIX + "notify"
NOTIFY_MAXLEN = 100_000

# Stream of notifier dead letters (jobs given up), trimmed to NOTIFIER_FAILURES_MAXLEN.
NOTIFIER_FAILURES = PREFIX + "notifier-failures"
NOTIFIER_FAILURES_MAXLEN = 1000


# Pub/sub channel: a session id, published after a command is queued for it;
# each replica's one subscriber wakes the long-polls waiting on that session.
COMMANDS_QUEUED = PREFIX + "commands-queued"

# Pub/sub channel: a job's command stream key (job_commands below), published
# after a job-wide command is added; replicas wake the polls of that job's sessions.
JOB_COMMANDS_QUEUED = PREFIX + "job-commands-queued"
JOB_COMMANDS_MAXLEN = 1000  # a job's commands kept (MAXLEN ~); sessions read on from their cursor

# Field of a session's hash: the id of the last entry of its job's command stream
# it acknowledged (or the stream's last id when it registered: older commands are
# not for it). Never listed (SessionOut ignores it).
JOB_CURSOR_FIELD = "job_cursor"
# The job command stream that cursor is in: a session re-registered under another job
# starts afresh in that job's stream (an id in one stream means nothing in another).
JOB_STREAM_FIELD = "job_cursor_stream"


def namespace_sessions(namespace: str) -> str:
    """Sorted set as SESSIONS, of one namespace's sessions ("" for none)."""
    return f"{PREFIX}namespace:{{{namespace}}}:sessions"


def job_sessions(job: str) -> str:
    """Sorted set as SESSIONS, of the sessions that registered with this job name
    (in any namespace: listings check each session's own fields)."""
    return f"{PREFIX}job:{{{job}}}:sessions"


def job_commands(namespace: str, job: str) -> str:
    """Stream of a job's job-wide commands (JSON), in one namespace ("" for none): stored
    once for every session of the job. TTL: retention, renewed on each command."""
    return f"{PREFIX}job-commands:{{{namespace}/{job}}}"


def job_stall(namespace: str, job: str) -> str:
    """Hash: the culprit line of a job's last job-wide stall report, in one namespace, and
    the step each rank was at (JSON), for the ranks whose own stall arrives after it
    (stalls.py). TTL: retention, renewed on each report."""
    return f"{PREFIX}job-stall:{{{namespace}/{job}}}"


def counts(scope: str, what: str) -> str:
    """String: a listing scope's per-state session counts (``what`` = "counts": JSON
    {counts, at}, shared by the replicas; TTL a few refresh periods) or the lock of
    the replica recounting them (``what`` = "counting"; TTL listing.COUNT_LOCK).
    ``scope``: a digest of the listing's namespace, job and visible namespaces."""
    return f"{PREFIX}{what}:{scope}"


def session(session_id: str) -> str:
    """Hash: the session's fields. TTL: settings.retention_seconds, renewed on each write."""
    return f"{PREFIX}session:{{{session_id}}}"


def alive(session_id: str) -> str:
    """String: present while heartbeats arrive. TTL: Broker.alive_ttl() (liveness.py);
    when it expires the session shows as lost (its hash stays)."""
    return f"{PREFIX}alive:{{{session_id}}}"


def session_events(session_id: str) -> str:
    """Stream of one session's events, trimmed to settings.session_stream_maxlen.
    TTL: settings.retention_seconds, renewed on each write."""
    return f"{PREFIX}events:{{{session_id}}}"


def seen(session_id: str, event_id: str) -> str:
    """String: marks an agent-chosen event id as ingested, so retries are dropped.
    TTL: settings.dedup_seconds (the window within which a retry is recognised)."""
    return f"{PREFIX}seen:{{{session_id}}}:{event_id}"


def commands(session_id: str) -> str:
    """List of queued commands (JSON), oldest at the right. TTL: retention, renewed on push."""
    return f"{PREFIX}commands:{{{session_id}}}"


def delivered(session_id: str) -> str:
    """List of commands handed to the agent but not yet acknowledged; redelivered
    on the next poll. TTL: retention, renewed on delivery."""
    return f"{PREFIX}delivered:{{{session_id}}}"


def notified(idempotency_key: str) -> str:
    """String: a notifier job was delivered, so a replica that claims it again (its
    acknowledgement was lost) does not deliver it twice. TTL: settings.notify_max_age."""
    return f"{PREFIX}notified:{idempotency_key}"


def login(cookie_digest: str) -> str:
    """String: JSON {token: digest, csrf}, a dashboard login, under the SHA-256 of its
    cookie (a copy of Redis holds no usable cookie). TTL: settings.login_seconds."""
    return f"{PREFIX}login:{cookie_digest}"
