"""The agent/broker protocol, written once: both distributions import it.

Standard library only (the broker depends on the ``breakpod`` distribution
for this module alone, so it must stay light). The broker's pydantic models
take their literals and patterns from here; a test pins that no other module
of either package spells these strings.

    event kinds  -> the session state each one moves to (STATE_OF_KIND)
    commands     -> what an admin may send an agent
    names        -> ids, addresses, Kubernetes names: patterns and limits
    paths        -> the HTTP API, one function per route the agent calls
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final, Literal, get_args

# -- events and states --------------------------------------------------------

EventKind = Literal[
    "anomaly",
    "stall",
    "parked",
    "waiting",
    "listening",
    "attached",
    "detached",
    "resumed",
    "finished",
    "command",
    "ci_failure",
    "log",
    "lost",
    "killed",
]
EVENT_KINDS: Final = frozenset(get_args(EventKind))
# What the broker itself records (an agent's would be forged): a command's delivery,
# a session whose heartbeats stopped, a runtime's word that the process was killed.
AGENT_EVENT_KINDS: Final = EVENT_KINDS - {"command", "lost", "killed"}
# Anything else an agent wants to say travels as this kind.
FALLBACK_KIND: Final = "log"
# A notifier's kinds are event kinds or the final states a death ends in: "failed"
# hears a session end with a non-zero exit, "killed" one end by a signal or the
# runtime's kill (see notified_as); "finished" hears every end, clean ones too.
NotifiedKind = Literal[EventKind, "failed"]
# Routed to notifiers unless a notifier names its own kinds: what needs someone now,
# deaths included, so an on-call hook hears a process die.
NOTIFIED_KINDS: Final[tuple[NotifiedKind, ...]] = (
    "anomaly",
    "stall",
    "parked",
    "lost",
    "killed",
    "failed",
)
# The broker's record of each step of a command's delivery (queued, delivered, done).
COMMAND_KIND: Final = "command"
# Each kind by name, for the modules that emit them (a test pins these to EventKind).
ANOMALY: Final = "anomaly"
STALL: Final = "stall"
PARKED: Final = "parked"
LISTENING: Final = "listening"
ATTACHED: Final = "attached"
DETACHED: Final = "detached"
RESUMED: Final = "resumed"
FINISHED: Final = "finished"
WAITING: Final = "waiting"  # a kind and the state it moves to
CI_FAILURE: Final = "ci_failure"
# The broker's own: heartbeats stopped (pushed once per death, deaths.py); the runtime
# (Docker engine, Kubernetes) says the process was killed, and why (fields: reason, exit).
LOST_KIND: Final = "lost"
KILLED: Final = "killed"
# Kinds whose fields announce the listener: {"address": HOST:PORT, "backend": listener}.
LISTENER_KINDS: Final = frozenset({"parked", "listening"})

State = Literal[
    "running", "parked", "waiting", "attached", "stalled", "finished", "failed", "killed"
]
STATES: Final = get_args(State)
LOST: Final = "lost"  # not stored: a session whose heartbeat expired reads as lost
LOST_REASON: Final = "no heartbeat"  # a lost session's reason, also not stored
Lost = Literal["lost"]
INITIAL_STATE: Final = "running"  # a session's state until an event says otherwise
# How a session ends: exit 0, a non-zero exit, a signal or the runtime's kill (OOM,
# eviction). Final states never read as lost and take no more commands; the first
# final event that says how the process ended settles it (see final_state).
FINAL_STATE: Final = "finished"
FAILED: Final = "failed"
KILLED_STATE: Final = "killed"
FINAL_STATES: Final = frozenset({FINAL_STATE, FAILED, KILLED_STATE})
STATE_OF_KIND: Final[dict[str, str]] = {
    "parked": "parked",
    "waiting": "waiting",  # paused because another rank of its job is parked
    "attached": "attached",
    "detached": "parked",  # the process keeps waiting for the next client
    "resumed": "running",
    "stall": "stalled",
    "finished": "finished",  # or failed / killed: final_state() reads its fields
    "killed": "killed",
}

# The flight recorder's dump rides under this field (anomaly, stall and dump-flight events).
FLIGHT_FIELD: Final = "flight"

# A park's fields: until when (unix seconds) the process waits for a debugger (absent:
# for ever); an attached event's: the debugger client's address.
HOLD_UNTIL_FIELD: Final = "hold_until"
CLIENT_FIELD: Final = "client"

# A heartbeat's body: {"step": N}, the process's last training step, when it counts them.
HEARTBEAT_STEP: Final = "step"

# The final event's fields say how the process ended: {"exit": N} or {"signal": N}.
EXIT_FIELD: Final = "exit"
SIGNAL_FIELD: Final = "signal"


SIGNAL_NAMES: Final = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 15: "SIGTERM"}


def _status(fields: dict[str, Any], name: str) -> int | None:
    value = fields.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def final_state(kind: str, fields: dict[str, Any]) -> tuple[str, str, bool] | None:
    """(state, reason, settled) for an event that ends a session, else None.

    ``finished`` with ``{"exit": 0}`` -> finished; a non-zero exit -> failed;
    ``{"signal": N}`` or a ``killed`` event (the runtime's word: OOMKilled,
    Evicted) -> killed. ``settled``: the event says how the process ended, and
    the first such word is kept: a job whose rank fails (exit 1) is then sent
    SIGTERM by its launcher while it exits, and that later signal is an echo, not
    the cause. A final event that does not say (an expired hold's ``finished``)
    leaves room for the one that does."""
    if STATE_OF_KIND.get(kind) not in FINAL_STATES:
        return None
    said = str(fields.get("reason") or fields.get("why") or "")
    signal, code = _status(fields, SIGNAL_FIELD), _status(fields, EXIT_FIELD)
    if kind == KILLED:
        how = said or (f"exit {code}" if code is not None else "killed")
        if code is not None and f"exit {code}" not in how:
            how += f" (exit {code})"
        return KILLED_STATE, how, True
    if signal is not None:
        return KILLED_STATE, f"signal {signal} ({SIGNAL_NAMES.get(signal, 'signal')})", True
    if code is not None:  # a failure in the runtime's words when they name it ("Error (exit 1)")
        if code and f"exit {code}" in said:
            return FAILED, said, True
        return (FINAL_STATE if code == 0 else FAILED), f"exit {code}", True
    return FINAL_STATE, said, False


def notified_as(kind: str, fields: dict[str, Any]) -> frozenset[str]:
    """The notifier kinds an event matches: its own kind and, for one that ends a
    session failed or killed, that state (a ``finished`` with exit 1 is ``failed``)."""
    ended = final_state(kind, fields)
    if ended is None or ended[0] == FINAL_STATE:
        return frozenset({kind})
    return frozenset({kind, ended[0]})


# -- commands -----------------------------------------------------------------

CommandName = Literal["break", "resume", "dump-stacks", "dump-flight", "detach"]
COMMANDS: Final = get_args(CommandName)
BREAK: Final = "break"
RESUME: Final = "resume"
DUMP_STACKS: Final = "dump-stacks"
DUMP_FLIGHT: Final = "dump-flight"  # the flight recorder's last steps, as a log event
DETACH: Final = "detach"
COMMAND_ID_PATTERN: Final = r"^[0-9a-f]{1,32}$"  # chosen by the broker
# How a delivered command ended (the ``state`` of its last command event): the agent
# handled it, or answered that it could not.
COMMAND_DONE: Final = "done"
COMMAND_FAILED: Final = "failed"
COMMAND_ENDED: Final = (COMMAND_DONE, COMMAND_FAILED)

# -- who and where ------------------------------------------------------------

Runtime = Literal["kubernetes", "compose", "docker", "local"]
RUNTIMES: Final = get_args(Runtime)
DEFAULT_RUNTIME: Final = "local"
KUBERNETES: Final = "kubernetes"  # reached through kubectl port-forward to the pod
DOCKER: Final = "docker"  # any container runtime the agent detects (compose says so itself)
ListenerKind = Literal["pdb", "debugpy"]
LISTENERS: Final = get_args(ListenerKind)
DEFAULT_LISTENER: Final = "pdb"
DAP_LISTENER: Final = "debugpy"  # editors (VS Code) attach to this one

SESSION_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SESSION_ID_MAX: Final = 128
# a TCP port, 1 to 65535
PORT_PATTERN: Final = r"(?:[1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])"
ADDRESS_PATTERN: Final = r"^\[?[A-Za-z0-9._:-]{1,200}\]?:" + PORT_PATTERN + "$"
EVENT_ID_PATTERN: Final = r"^[A-Za-z0-9._-]{1,160}$"  # a session id, ".", a number
# Kubernetes object names (they reach the engineer's kubectl argv): DNS-1123.
DNS_LABEL_MAX: Final = 63
DNS_SUBDOMAIN_MAX: Final = 253
DNS_LABEL_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# No look-ahead (pydantic's regex engine has none): the length is checked apart.
DNS_SUBDOMAIN_PATTERN: Final = (
    r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"
)
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", ""})


def is_dns_label(name: str) -> bool:
    return re.match(DNS_LABEL_PATTERN, name) is not None


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= DNS_SUBDOMAIN_MAX and re.match(DNS_SUBDOMAIN_PATTERN, name) is not None


def reachable(address: str) -> str:
    """A wildcard bind (a container publishing its port) is reached on 127.0.0.1."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in WILDCARD_HOSTS else address


# -- the HTTP API -------------------------------------------------------------

HEALTHZ: Final = "/healthz"  # no token needed
API: Final = "/v1"
SESSIONS: Final = f"{API}/sessions"
EVENTS: Final = f"{API}/events"
EVENTS_STREAM: Final = f"{EVENTS}/stream"
WHOAMI: Final = f"{API}/whoami"
LOGIN: Final = f"{API}/login"  # the dashboard's: a token in, a session cookie out
LOGOUT: Final = f"{API}/logout"
TOKENS: Final = f"{API}/tokens"
NOTIFIERS: Final = f"{API}/notifiers"
JOBS: Final = f"{API}/jobs"


def session_path(session_id: str) -> str:
    return f"{SESSIONS}/{session_id}"


def heartbeat_path(session_id: str) -> str:
    return f"{session_path(session_id)}/heartbeat"


def commands_path(session_id: str) -> str:
    return f"{session_path(session_id)}/commands"


def ack_path(session_id: str, command_id: str) -> str:
    return f"{commands_path(session_id)}/{command_id}/ack"


def job_commands_path(job: str) -> str:
    """One command for every session of a job (admin): stored once, each session gets it once."""
    return f"{JOBS}/{job}/commands"


def attach_path(session_id: str) -> str:
    return f"{session_path(session_id)}/attach"


def token_path(token_id: str) -> str:
    return f"{TOKENS}/{token_id}"


# -- editors ------------------------------------------------------------------


def vscode_launch(
    name: str,
    host: str,
    port: int,
    *,
    local_root: str = "${workspaceFolder}",
    remote_root: str = ".",
) -> dict[str, Any]:
    """A VS Code ``launch.json`` that attaches to a debugpy listener."""
    attach = {
        "name": f"breakpod: {name}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": host, "port": port},
        "pathMappings": [{"localRoot": local_root, "remoteRoot": remote_root}],
        "justMyCode": False,
    }
    return {"version": "0.2.0", "configurations": [attach]}


# -- JSON ---------------------------------------------------------------------


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as "nan", "inf", "-inf": JSON has no such
    numbers (Python's json writes invalid tokens), and an anomaly's loss is often one.
    Iterative, so a deeply nested value cannot exhaust the stack."""
    root: list[Any] = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, float) and not math.isfinite(item):
            parent[key] = "nan" if math.isnan(item) else ("inf" if item > 0 else "-inf")
        elif isinstance(item, dict):
            parent[key] = mapping = dict(item)
            stack.extend((mapping, k) for k in mapping)
        elif isinstance(item, (list, tuple)):
            parent[key] = items = list(item)
            stack.extend((items, i) for i in range(len(items)))
    return root[0]


def dumps(doc: Any) -> str:
    """Strict JSON, as the broker accepts it: non-finite floats become strings, and half
    of a UTF-16 pair (a file name or environment value of bytes that are not UTF-8, as
    Python reads them) becomes U+FFFD: the broker refuses a string that is not text."""
    try:
        text = json.dumps(doc, default=str, allow_nan=False)
    except ValueError:  # the rare document with a NaN: pay for the copy only then
        text = json.dumps(finite(doc), default=str, allow_nan=False)
    if "\\ud" not in text:  # no surrogate escaped, paired (an emoji) or not
        return text
    loose = json.dumps(json.loads(text), ensure_ascii=False)  # a pair is one character here
    if not _HALF_PAIR.search(loose):
        return text
    return json.dumps(json.loads(_HALF_PAIR.sub("\ufffd", loose)))


_HALF_PAIR = re.compile("[\ud800-\udfff]")
