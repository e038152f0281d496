"""The proxies the broker believes: ``trusted_proxies`` (``BREAKPOD_TRUSTED_PROXIES``).

Behind an Ingress that terminates TLS the broker sees plain HTTP from the
controller's address. A request from a peer on the list is taken as the proxy
says: ``X-Forwarded-Proto`` sets the scheme (the dashboard's login cookie is then
marked ``Secure``) and ``X-Forwarded-For`` the client's address (the access log).
Headers from any other peer are ignored, so nobody else can claim either. The
list is empty by default: no proxy is believed (uvicorn's own belief in
127.0.0.1 is turned off in ``serving.py``, so this is the only one).
"""

from __future__ import annotations

import functools
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
SCHEMES = frozenset({"http", "https"})


def parse(text: str) -> tuple[Network, ...]:
    """``10.42.0.0/16, 192.168.1.7``: networks; ValueError naming an entry that is not one."""
    networks = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(
                f"{entry!r} is not an IP address or CIDR: list the proxies' addresses, "
                "e.g. 10.42.0.0/16,127.0.0.1"
            ) from None
    return tuple(networks)


_networks = functools.lru_cache(maxsize=4)(parse)  # the settings' one string, parsed once


def trusted(host: str | None, networks: tuple[Network, ...]) -> bool:
    try:
        address = ipaddress.ip_address((host or "").split("%")[0])
    except ValueError:
        return False
    return any(address in network for network in networks)


def client_of(forwarded_for: str, networks: tuple[Network, ...]) -> str | None:
    """The client behind the proxies: the right-most address not itself a trusted
    proxy (those left of it were written by whoever connected, and prove nothing)."""
    hops = [hop.strip() for hop in forwarded_for.split(",") if hop.strip()]
    for hop in reversed(hops):
        if not trusted(hop, networks):
            return hop
    return hops[0] if hops else None


class TrustedProxies:
    """ASGI middleware: a trusted peer's forwarded scheme and client replace its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            networks = _networks(scope["app"].state.broker.settings.trusted_proxies)
            peer = scope.get("client")
            if networks and peer and trusted(peer[0], networks):
                _forwarded(scope, networks)
        await self.app(scope, receive, send)


def _forwarded(scope: Scope, networks: tuple[Network, ...]) -> None:
    headers = dict(scope["headers"])  # the last of a repeated header: the nearest proxy's
    proto = headers.get(b"x-forwarded-proto", b"").decode("latin-1")
    scheme = proto.rpartition(",")[2].strip().lower()
    if scheme in SCHEMES:
        scope["scheme"] = scheme
    forwarded_for = b", ".join(v for k, v in scope["headers"] if k == b"x-forwarded-for")
    client = client_of(forwarded_for.decode("latin-1"), networks) if forwarded_for else None
    if client:
        scope["client"] = (client, 0)
