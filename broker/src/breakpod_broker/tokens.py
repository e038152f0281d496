"""Bearer tokens: parsing, hashing and lookup (no HTTP here: see :mod:`.auth`).

Roles: ``agent`` registers sessions and writes only its own sessions' events,
``viewer`` reads, ``admin`` does everything (commands, token management).
Static tokens come from ``BREAKPOD_BROKER_TOKENS`` ("role:token,...") or a
tokens file; admins create more through the API (kept in Redis, so every
replica sees them). A token may be limited to some namespaces. Only a token's
SHA-256 is ever stored.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from breakpod_broker import keys
from breakpod_broker.errors import ConfigError

log = logging.getLogger(__name__)
MIN_TOKEN_LENGTH = 8


class Role(str, enum.Enum):
    agent = "agent"
    viewer = "viewer"
    admin = "admin"


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a token speaks for."""

    role: Role
    token_id: str  # first hex digits of the token's SHA-256: safe to log and store
    name: str = ""
    namespaces: frozenset[str] | None = None  # None: every namespace

    def may_see(self, namespace: str | None) -> bool:
        return self.namespaces is None or (namespace or "") in self.namespaces


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def principal(
    token: str, role: str, name: str = "", namespaces: Iterable[str] | None = None
) -> Principal:
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"token for role {role!r} is shorter than {MIN_TOKEN_LENGTH} characters")
    try:
        parsed = Role(role)
    except ValueError:
        raise ConfigError(f"unknown role {role!r}: use agent, viewer or admin") from None
    ns = frozenset(namespaces) if namespaces is not None else None
    return Principal(parsed, digest(token)[:12], name, ns)


def parse_token_pairs(text: str) -> dict[str, Principal]:
    """``"role:token,role:token"`` -> {digest: principal}."""
    found: dict[str, Principal] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        role, sep, token = pair.partition(":")
        if not sep or not token:
            raise ConfigError(f"BREAKPOD_BROKER_TOKENS entry {pair!r} is not role:token")
        found[digest(token)] = principal(token, role.strip(), f"env:{role.strip()}")
    return found


def load_tokens_file(path: Path) -> dict[str, Principal]:
    """YAML/JSON ``{tokens: {TOKEN: ROLE | {role, namespaces, name}}}``; ``tokens:`` optional."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read tokens file {path}: {e}") from e
    entries = data.get("tokens", data) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: expected a mapping of token -> role or {{role, namespaces}}")
    return {digest(str(t)): _file_entry(path, str(t), spec) for t, spec in entries.items()}


def _file_entry(path: Path, token: str, spec: Any) -> Principal:
    if isinstance(spec, str):
        return principal(token, spec, f"file:{spec}")
    if not isinstance(spec, dict) or "role" not in spec:
        raise ConfigError(f"{path}: each token needs a role, e.g. {{role: viewer}}")
    namespaces = spec.get("namespaces")
    if namespaces is not None and not isinstance(namespaces, list):
        raise ConfigError(f"{path}: namespaces must be a list of names")
    return principal(token, str(spec["role"]), str(spec.get("name", "")), namespaces)


def dev_tokens() -> dict[Role, str]:
    """One fresh token per role, for ``serve --dev``."""
    return {role: f"bp-{role.value}-{secrets.token_urlsafe(18)}" for role in Role}


class TokenStore:
    """Static tokens from settings plus admin-made tokens in Redis."""

    def __init__(self, static: Mapping[str, Principal], redis: Any) -> None:
        self.static = dict(static)
        self.redis = redis

    async def lookup(self, token: str) -> Principal | None:
        return await self.by_digest(digest(token))

    async def by_digest(self, key: str) -> Principal | None:
        """The principal of the token whose SHA-256 is ``key`` (a login remembers that)."""
        if key in self.static:
            return self.static[key]
        raw = await self.redis.hget(keys.TOKENS, key)
        return None if raw is None else _decode(key, raw)  # a corrupt record: None too

    async def create(
        self, role: Role, name: str, namespaces: list[str] | None
    ) -> tuple[str, Principal]:
        token = f"bp-{role.value}-{secrets.token_urlsafe(24)}"
        record = {"role": role.value, "name": name, "namespaces": namespaces}
        await self.redis.hset(keys.TOKENS, digest(token), json.dumps(record))
        ns = None if namespaces is None else frozenset(namespaces)
        return token, Principal(role, digest(token)[:12], name, ns)

    async def list(self) -> list[Principal]:
        stored = await self.redis.hgetall(keys.TOKENS)
        decoded = (_decode(k, v) for k, v in stored.items())
        return [*self.static.values(), *(p for p in decoded if p is not None)]

    async def delete(self, token_id: str) -> bool:
        for key in await self.redis.hkeys(keys.TOKENS):
            if key.startswith(token_id):
                return bool(await self.redis.hdel(keys.TOKENS, key))
        return False


def _decode(key: str, raw: str) -> Principal | None:
    """The stored record, or None (logged) when it is not one this broker wrote."""
    try:
        record = json.loads(raw)
        ns = record.get("namespaces")
        return Principal(
            Role(record["role"]),
            key[:12],
            str(record.get("name", "")),
            None if ns is None else frozenset(str(n) for n in ns),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        log.error(
            "token record %s in %s is corrupt (%r): treated as revoked", key[:12], keys.TOKENS, e
        )
        return None
