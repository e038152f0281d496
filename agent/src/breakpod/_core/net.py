"""Addresses and binds: loopback by default, anything else only when opted in."""

from __future__ import annotations

import errno
import ipaddress
import socket

from breakpod import protocol
from breakpod._core.announce import announce
from breakpod._core.errors import ConfigError, InsecureBindError, ListenerError


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``/``::``: bound on every interface (a container's published port)."""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets (what :func:`parse_address` reads)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_address(host: str, port: int) -> str:
    """Where a client on the same host (or container) connects to a listener."""
    return format_address("127.0.0.1" if is_wildcard(host) else host, port)


def check_bind(host: str, *, backend: str, token: str | None, allow_insecure: bool) -> None:
    """Refuse a non-loopback bind that lacks its opt-in, saying what to set."""
    if is_loopback(host):
        return
    if backend == protocol.DEFAULT_LISTENER and not token:
        raise InsecureBindError(
            f"refusing to bind the remote pdb to non-loopback address {host!r} without a token: "
            "set BREAKPOD_LISTENER_TOKEN (clients must send it as their first line), "
            "or keep BREAKPOD_HOST=127.0.0.1 and use kubectl port-forward / docker exec"
        )
    if backend == protocol.DAP_LISTENER and not allow_insecure:
        raise InsecureBindError(
            f"refusing to bind debugpy to non-loopback address {host!r}: debugpy has no client "
            "authentication, so anyone who reaches the port can run code in this process. "
            "Set BREAKPOD_ALLOW_INSECURE=1 to accept that, or keep BREAKPOD_HOST=127.0.0.1 "
            "and use kubectl port-forward"
        )


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` -> (host, port), with a clear error."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 < port <= 65535:
        raise ConfigError(f"{text!r} is not HOST:PORT (for example 127.0.0.1:5678)")
    return host, port


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a busy port falls back to a free one with a warning."""
    try:
        return _listen(host, port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE or port == 0:
            raise ListenerError(f"cannot listen on {host}:{port}: {e.strerror}") from e
        announce(f"port {port} is in use; listening on a free port instead")
        return _listen(host, 0)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # a burst of connects must not drop the real client's SYN
    except OSError:
        sock.close()
        raise
    return sock
