"""A park: the process held at a frame until a debugger client attaches, or its hold
time passes. One :class:`Park` per park owns its lifecycle and sends its events to the
hub, from here only: ``parked``, ``attached``, ``detached``, ``resumed``.

How a park waits for a client::

    open_pdb() / open_dap()     announce where to attach; ``parked``; the process is held
      │                         (``_core/holding``: a held process is not a stalled one)
      ├─ pdb: the listener's one slot (listener.py: the token, one client at a time)
      │  debugpy: debugpy.wait_for_client(), ended at the hold time
      ├─ a client attached      ``attached``: the debugger runs (remote_pdb.RemotePdb over
      │                         PdbPark.io; ``continue`` -> ``resumed``, a hang-up ->
      │                         ``detached``, then the next client or the job goes on)
      └─ nobody in time, a broker ``resume``, a signal     ``resumed``: the job goes on

Which debugger serves a park (debugpy, local pdb on a TTY, the remote pdb) is decided a
layer up, in ``breakpoints.py``.
"""

from __future__ import annotations

import os
import socket
import time

from breakpod import protocol
from breakpod._core import events, holding, net, wiring
from breakpod._core.announce import announce
from breakpod._core.config import Settings, format_seconds
from breakpod._debug import debugger
from breakpod._debug.listener import ClientIO, Listener


class Park:
    """One park's lifecycle: held while it waits (and, for pdb, while a client is
    attached), each event sent once from here."""

    backend = protocol.DEFAULT_LISTENER

    def __init__(self, reason: str, hold_seconds: float, address: str) -> None:
        self.reason = reason
        self.hold_seconds = hold_seconds
        self.address = address
        self._held = False

    def set_held(self, held: bool) -> None:
        """A held process is not a stalled one (the watchdog reads the count); a park
        holds once, and lets go once."""
        if held != self._held:
            self._held = held
            (holding.hold if held else holding.release)()

    def parked(self, hint: str, *, deadline: bool = True) -> None:
        """Announce the park (``hint``: how to attach) and hold the process."""
        wiring.connect()  # reports the park to the broker when BREAKPOD_BROKER_URL is set
        announce(f"{self.reason}: waiting up to {format_seconds(self.hold_seconds)} for {hint}")
        until = hold_until(self.hold_seconds) if deadline else None
        self._emit(
            protocol.PARKED,
            backend=self.backend,
            reason=self.reason,
            **({protocol.HOLD_UNTIL_FIELD: until} if until is not None else {}),
        )

    def attached(self, client: str | None = None) -> None:
        fields = {protocol.CLIENT_FIELD: client} if client is not None else {}
        self._emit(protocol.ATTACHED, reason=self.reason, **fields)

    def detached(self, why: str, *, waits_again: bool = True) -> None:
        until = hold_until(self.hold_seconds) if waits_again else None
        self._emit(
            protocol.DETACHED,
            why=why,
            **({protocol.HOLD_UNTIL_FIELD: until} if until is not None else {}),
        )

    def resumed(self, why: str | None = None, *, said: str | None = None) -> None:
        """The park is over, the job goes on; ``said``: announce ``why`` with it."""
        self.set_held(False)
        if said is not None:
            announce(f"{why}; {said}")
        self._emit(protocol.RESUMED, **({"why": why} if why is not None else {}))

    def interrupted(self, error: BaseException) -> None:
        """The wait ended by an exception (a signal handler's, Ctrl-C): say so."""
        why = f"interrupted by {type(error).__name__}"
        announce(f"{why} while waiting for a debugger; the park ends")
        self.resumed(why)

    def _emit(self, kind: str, **fields: object) -> None:
        events.emit(kind, address=self.address, **fields)


class PdbPark(Park):
    """A park on the remote pdb listener: its client and the detach policy."""

    def __init__(
        self, listener: Listener, *, reason: str, hold_seconds: float, on_detach: str
    ) -> None:
        super().__init__(reason, hold_seconds, listener.address)
        self.listener = listener
        self.on_detach = on_detach
        self.io = ClientIO(idle_seconds=listener.attach_idle)
        self._client: socket.socket | None = None

    @property
    def client(self) -> socket.socket | None:
        return self._client

    def wait(self) -> bool:
        """Wait up to the hold time for a client; True when one attached."""
        self.set_held(True)  # a parked or attached process is not a stalled one
        timeout = None if self.hold_seconds == float("inf") else self.hold_seconds
        try:
            sock = self.listener.wait_for_client(timeout)
        except BaseException:  # a signal handler's exception: the process runs on, unheld
            self.set_held(False)
            raise
        if sock is None:
            self.set_held(False)
            return False
        self._client = sock
        _attached.append(self)
        self.io.attach(sock)
        self.io.write(f"breakpod: attached to pid {os.getpid()}: {self.reason}\n")
        self.attached(_peer(sock))
        return True

    def end(self, why: str) -> None:
        """The client's session is over (it may wait again: see ``on_detach``)."""
        self.set_held(False)
        if self._client is None:
            return
        self.io.write(f"breakpod: {why}\n")
        self.io.close()
        self.listener.release(self._client)
        self._client = None
        if self in _attached:
            _attached.remove(self)
        self.detached(why)  # a detached process waits again, as long


def open_pdb(
    settings: Settings, reason: str, hold_seconds: float, then: str = "continuing"
) -> PdbPark | None:
    """Park on the remote pdb listener and wait for a client; None when none came."""
    listener = debugger.pdb_listener(settings)
    park = PdbPark(listener, reason=reason, hold_seconds=hold_seconds, on_detach=settings.on_detach)
    target = net.local_address(listener.host, listener.port)
    park.parked(
        f"a debugger on {park.address}; attach with: breakpod attach {target}  "
        f"(or: nc {nc_args(target)})"
        + ("; a token is required: set BREAKPOD_LISTENER_TOKEN" if listener.requires_token else "")
    )
    try:
        attached = park.wait()
    except BaseException as e:
        park.interrupted(e)
        raise
    if attached:
        return park
    why = listener.interrupted or f"nobody attached within {format_seconds(hold_seconds)}"
    park.resumed(why, said=then)
    return None


def open_dap(reason: str, hold_seconds: float) -> Park | None:
    """Park on the running debugpy listener; the park once a DAP client attached, else None."""
    endpoint = debugger.debugpy_endpoint()
    assert endpoint is not None
    park = Park(reason, hold_seconds, endpoint.address)
    park.backend = protocol.DAP_LISTENER
    park.parked(f"a DAP client on {endpoint.address}", deadline=False)
    park.set_held(True)
    try:
        attached = debugger.wait_for_debugpy_client(hold_seconds)
    except BaseException as e:
        park.interrupted(e)
        raise
    finally:
        park.set_held(False)
    if not attached:
        announce(f"nobody attached within {format_seconds(hold_seconds)}; continuing")
        park.resumed("hold time passed")
        return None
    park.attached()
    return park


_attached: list[PdbPark] = []  # pdb parks with a client now (one may nest in another)


def attached_now() -> PdbPark | None:
    """The innermost pdb park a client is attached to (a broker ``resume`` hangs up)."""
    return _attached[-1] if _attached else None


def hold_until(hold_seconds: float) -> float | None:
    """When a park that starts now stops waiting (unix seconds); None: it waits for ever."""
    return None if hold_seconds == float("inf") else time.time() + hold_seconds


def nc_args(target: str) -> str:
    """``HOST PORT`` for nc, from ``HOST:PORT`` or ``[V6]:PORT``."""
    host, _, port = target.rpartition(":")
    return f"{host.strip('[]')} {port}"


def _peer(sock: socket.socket) -> str:
    """The debugger client's address, as the listener sees it ("" when unknown)."""
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return ""
    return f"{host}:{port}"
