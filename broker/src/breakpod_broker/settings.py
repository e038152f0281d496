"""Broker settings: explicit argument > ``BREAKPOD_*`` environment > safe default.

Built in the app lifespan (or by the CLI), never at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, HttpUrl, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from breakpod import protocol
from breakpod.protocol import NotifiedKind
from breakpod_broker import proxies


class Notifier(BaseModel):
    """One webhook sink and the event kinds (or death states) routed to it."""

    name: str = Field(min_length=1, max_length=64)
    url: HttpUrl
    format: Literal["json", "slack"] = "json"
    kinds: list[NotifiedKind] = Field(default_factory=lambda: list(protocol.NOTIFIED_KINDS))
    # None: retry until the job is notify_max_age old; a number: give up sooner
    retries: int | None = Field(default=None, ge=0)
    backoff_seconds: float = Field(default=0.5, gt=0, le=60)
    max_backoff_seconds: float = Field(default=60.0, gt=0, le=3600)  # the doubling stops here
    timeout_seconds: float = Field(default=5.0, gt=0, le=60)


ENV_PREFIX = "BREAKPOD_"


class BrokerSettings(BaseSettings):
    """Everything the broker reads; docs/settings.md lists them (generated from here)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # BREAKPOD_BROKER_HOST/PORT: plain BREAKPOD_HOST/PORT belong to the agent's listener
    broker_host: str = "127.0.0.1"
    broker_port: int = Field(default=8765, ge=0, le=65535)
    redis_url: str | None = None  # None: start an embedded redis-server
    # a Redis Cluster at redis_url (any node)? None: ask the server (INFO cluster)
    redis_cluster: bool | None = None
    data_dir: Path = Path(".breakpod/broker")
    broker_tokens: str = ""  # "role:token,role:token"
    tokens_file: Path | None = None
    notifiers: list[Notifier] = Field(default_factory=list)  # JSON in BREAKPOD_NOTIFIERS
    # a notifier job a replica took but did not finish this long ago is taken over
    notify_claim_seconds: float = Field(default=300.0, gt=0)
    # a notifier job still undelivered this long after its event is dead-lettered
    notify_max_age: float = Field(default=3600.0, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_batch: int = Field(default=1000, ge=1, le=10_000)
    global_stream_maxlen: int = Field(default=100_000, ge=100)
    session_stream_maxlen: int = Field(default=10_000, ge=10)
    heartbeat_ttl_seconds: int = Field(default=30, ge=1)
    # beats per second all sessions together aim at: beyond 15 s x this many
    # sessions, agents are asked to beat less often (and liveness scales with it)
    heartbeat_rate: float = Field(default=200.0, gt=0)
    retention_seconds: int = Field(default=7 * 24 * 3600, ge=60)
    dedup_seconds: int = Field(default=3600, ge=1)
    max_poll_seconds: float = Field(default=30.0, gt=0, le=300)
    # long polls + SSE streams one replica serves at once (each may hold a Redis connection)
    max_waiters: int = Field(default=256, ge=1, le=10_000)
    metrics_cache_seconds: float = Field(default=15.0, ge=0)  # /metrics session counts
    # HTTPS for the API: a PEM certificate (chain) and its key; agents verify it
    # with BREAKPOD_BROKER_CA (or the system's CAs)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_stream_seconds: float = Field(default=3600.0, gt=0)  # SSE clients then resume
    # an SSE client that takes nothing this long (its socket's buffers full) is dropped
    stream_stall_seconds: float = Field(default=30.0, gt=0)
    # a request body not all received this long after its headers gets 408
    body_seconds: float = Field(default=30.0, gt=0)
    login_seconds: int = Field(default=12 * 3600, ge=60, le=30 * 24 * 3600)  # a dashboard login
    # peers whose X-Forwarded-Proto/-For the broker believes (proxies.py): IPs/CIDRs
    trusted_proxies: str = ""
    shutdown_seconds: float = Field(default=20.0, gt=0, le=3600)  # serving.py: then it gives up
    # SSE streams one replica serves (each costs memory: a queue of follower_queue events)
    max_followers: int = Field(default=10_000, ge=1, le=1_000_000)
    # a follower this many events behind is dropped; it resumes with Last-Event-ID
    follower_queue: int = Field(default=10_000, ge=10, le=1_000_000)
    # why a process died, from its runtime: the Docker engine's events (auto: when the
    # docker package is installed and an engine answers), the sessions' pods (in-cluster)
    docker_watch: Literal["auto", "on", "off"] = "auto"
    pod_watch: bool = False
    pod_watch_namespaces: str = ""  # comma list; empty: the broker's own namespace

    @field_validator("trusted_proxies")
    @classmethod
    def _addresses(cls, value: str) -> str:
        proxies.parse(value)  # a typo must not leave the cookie without Secure unnoticed
        return value


# What each setting means, for `docs/settings.md` (generated: docs/gen_settings.py).
HELP: dict[str, str] = {
    "broker_host": "bind address (plain `BREAKPOD_HOST` is the agent's listener)",
    "broker_port": "port",
    "redis_url": "Redis to use; unset: an embedded redis-server in the data directory",
    "redis_cluster": "Redis Cluster client (true) or a single Redis (false); unset: ask the server",
    "data_dir": "embedded Redis data (AOF, `lock`, `redis.pid`) and `serve --dev` tokens",
    "broker_tokens": "static tokens, `role:token,role:token` (roles agent, viewer, admin)",
    "tokens_file": "YAML/JSON `tokens: {TOKEN: ROLE}` or `{TOKEN: {role, namespaces, name}}`",
    "notifiers": "JSON list of webhook notifiers (name, url, format, kinds, retries, ...)",
    "notify_claim_seconds": "a notifier job unfinished this long is taken over by another replica",
    "notify_max_age": "a notifier job undelivered this long after its event is dead-lettered",
    "max_body_bytes": "larger request bodies get 413",
    "max_batch": "most events in one batch an agent posts (more: 413)",
    "global_stream_maxlen": "events kept in the global stream (`XADD MAXLEN ~`)",
    "session_stream_maxlen": "events kept per session",
    "heartbeat_ttl_seconds": "a session silent this long shows `lost` (reason: no heartbeat) "
    "and a `lost` event is recorded within a second; with agents beating every 15 s, two "
    "missed beats; scaled with the interval when it grows",
    "heartbeat_rate": "heartbeats per second all sessions together aim at: with more than "
    "15 s x this many sessions, agents are asked to beat less often (`heartbeat_seconds`)",
    "retention_seconds": "how long a silent session (and its stream) is kept",
    "dedup_seconds": "window in which a retried event id is recognised",
    "max_poll_seconds": "longest command long-poll",
    "max_waiters": "size of the blocking Redis pool (notifier queue); long polls are not capped",
    "max_followers": "SSE streams one replica serves (beyond: 429)",
    "follower_queue": "a stream this many events behind is dropped; it resumes with Last-Event-ID",
    "metrics_cache_seconds": "`/metrics` session counts are recounted at most this often",
    "tls_cert_file": "serve the API over HTTPS with this PEM certificate (chain)",
    "tls_key_file": "the certificate's PEM key",
    "max_stream_seconds": "an SSE stream then ends; clients resume with `Last-Event-ID`",
    "stream_stall_seconds": "an SSE client that takes no data this long (it stopped reading) "
    "is dropped, and its stream's place freed",
    "body_seconds": "a request body not all received this long after its headers gets 408",
    "login_seconds": "a dashboard login (its HttpOnly cookie) lasts this long",
    "trusted_proxies": "comma list of proxy IPs/CIDRs (an Ingress controller's pods) whose "
    "`X-Forwarded-Proto`/`-For` the broker believes: behind one that terminates TLS the "
    "dashboard cookie is `Secure`; empty: no proxy is believed",
    "docker_watch": "`auto`, `on` or `off`: record why a container's process died (OOMKilled, "
    "exit code, signal) from the Docker engine's events; auto: when the `docker` package is "
    "installed and an engine answers (`DOCKER_HOST` or its socket); on: refuse to start without",
    "pod_watch": "record why a session's pod died (OOMKilled, Evicted, Error (exit 1), node "
    "lost) from a watch on its pods (the `kubernetes` package, in-cluster; the chart's "
    "`podWatch.enabled` grants the Role)",
    "pod_watch_namespaces": "comma list of namespaces whose pods are watched; empty: the "
    "broker's own",
    "shutdown_seconds": "after SIGTERM/SIGINT the broker has this long to stop; then (or at a "
    "second signal) its embedded redis-server is stopped and it exits 1, saying why",
}
