"""Exponential delays after failed tokens, so a listener's token cannot be guessed fast.

After the n-th failure in a row the next token is judged no earlier than
``BASE_DELAY * 2**(n-1)`` seconds after it, capped. Two counters apply, and a
token waits for both: one overall (every client) and one per peer address.
Clients behind ``kubectl port-forward`` or ``docker exec`` all come from
loopback, so loopback peers share the overall counter only, whose cap stays
short enough for the real engineer to get in within about a second while
someone else guesses. A quiet period or a right token resets a counter.
"""

from __future__ import annotations

import ipaddress

BASE_DELAY = 0.05
OVERALL_CAP = 1.0  # every client waits at most this long, whoever else is guessing
PEER_CAP = 30.0  # a remote address that keeps guessing waits up to this long
FORGET_AFTER = 60.0  # seconds without a failure reset a counter
MAX_PEERS = 1024


class Backoff:
    """Failures in a row and when the last one happened."""

    __slots__ = ("cap", "failures", "last")  # a plain class: every listener imports this cheaply

    def __init__(self, cap: float, failures: int = 0, last: float = 0.0) -> None:
        self.cap, self.failures, self.last = cap, failures, last

    def wait(self, now: float) -> float:
        """Seconds until the next token may be judged (0: now)."""
        if not self.failures or now - self.last > FORGET_AFTER:
            return 0.0
        delay: float = min(BASE_DELAY * 2.0 ** min(self.failures - 1, 30), self.cap)
        return max(0.0, self.last + delay - now)

    def failed(self, now: float) -> None:
        if now - self.last > FORGET_AFTER:
            self.failures = 0
        self.failures, self.last = self.failures + 1, now

    def reset(self) -> None:
        self.failures = 0


class Throttle:
    """The overall counter plus one per remote (non-loopback) peer."""

    def __init__(self) -> None:
        self.overall = Backoff(OVERALL_CAP)
        self._peers: dict[str, Backoff] = {}

    def wait(self, peer: str, now: float) -> float:
        own = self._peers.get(peer)
        return max(self.overall.wait(now), own.wait(now) if own is not None else 0.0)

    def failed(self, peer: str, now: float) -> None:
        self.overall.failed(now)
        if _is_remote(peer):
            self._peer(peer, now).failed(now)

    def succeeded(self, peer: str) -> None:
        self.overall.reset()
        self._peers.pop(peer, None)

    def _peer(self, peer: str, now: float) -> Backoff:
        if peer not in self._peers and len(self._peers) >= MAX_PEERS:
            self._forget(now)
        return self._peers.setdefault(peer, Backoff(PEER_CAP))

    def _forget(self, now: float) -> None:
        """Drop quiet peers; if all are recent, the oldest half (memory stays bounded)."""
        quiet = [p for p, b in self._peers.items() if now - b.last > FORGET_AFTER]
        oldest = sorted(self._peers, key=lambda p: self._peers[p].last)
        for peer in quiet or oldest[: len(oldest) // 2]:
            del self._peers[peer]


def _is_remote(peer: str) -> bool:
    try:
        address = ipaddress.ip_address(peer.split("%")[0])
    except ValueError:
        return True
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return not (mapped or address).is_loopback
