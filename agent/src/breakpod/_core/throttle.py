"""Exponential delays after failed tokens, so a listener's token cannot be guessed fast.

Two counters apply, and a token waits for both. The overall one (every client):
after a failure, the next token is compared no earlier than ``OVERALL_CAP``
seconds later. The listener compares one token per opening, right or wrong, so
this bounds the guesses per second however many connections guess at once: one
every ``OVERALL_CAP`` seconds (under 2 a second). One per remote peer address:
after its n-th failure in a row, ``BASE_DELAY * 2**(n-1)`` seconds, up to
``PEER_CAP``. Clients behind ``kubectl port-forward`` or ``docker exec`` all
come from loopback, so loopback peers share the overall counter only; the real
engineer's token then
waits its turn behind the lines sent before it (about ``OVERALL_CAP`` seconds
each). A quiet period resets a counter; a right token its peer's (not the
overall one: the engineer getting in must not restart a guesser's count).
"""

from __future__ import annotations

import ipaddress

BASE_DELAY = 0.05
OVERALL_CAP = 0.6  # one comparison at least this far apart under a flood: < 2 guesses/s
PEER_CAP = 30.0  # a remote address that keeps guessing waits up to this long
FORGET_AFTER = 60.0  # seconds without a failure reset a counter
MAX_PEERS = 1024


class Backoff:
    """Failures in a row and when the last one happened."""

    __slots__ = ("base", "cap", "failures", "last")  # a plain class: imported cheaply

    def __init__(self, cap: float, base: float = BASE_DELAY) -> None:
        self.cap, self.base, self.failures, self.last = cap, base, 0, 0.0

    def wait(self, now: float) -> float:
        """Seconds until the next token may be judged (0: now)."""
        if not self.failures or now - self.last > FORGET_AFTER:
            return 0.0
        delay: float = min(self.base * 2.0 ** min(self.failures - 1, 30), self.cap)
        return max(0.0, self.last + delay - now)

    def failed(self, now: float) -> None:
        if now - self.last > FORGET_AFTER:
            self.failures = 0
        self.failures, self.last = self.failures + 1, now


class GuessThrottle:
    """The overall counter plus one per remote (non-loopback) peer."""

    def __init__(self) -> None:
        self.overall = Backoff(OVERALL_CAP, base=OVERALL_CAP)  # no ramp: the cap at once
        self._peers: dict[str, Backoff] = {}

    def wait(self, peer: str, now: float) -> float:
        own = self._peers.get(peer)
        return max(self.overall.wait(now), own.wait(now) if own is not None else 0.0)

    def failed(self, peer: str, now: float) -> None:
        self.overall.failed(now)
        if _is_remote(peer):
            self._peer(peer, now).failed(now)

    def succeeded(self, peer: str) -> None:
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
