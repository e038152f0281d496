"""What the agent does with each command the broker delivers.

    break        park at the next step boundary (breakpod.break_if_requested()); in a
                 job in debug mode every rank parks at one agreed step (_job/pause.py)
    resume       stop waiting for a debugger, or hang up on the attached one; continue
    detach       hang up on the attached debugger (the program follows BREAKPOD_ON_DETACH)
    dump-stacks  send every thread's stack as a ``log`` event
    dump-flight  send the flight recorder's last steps as a ``log`` event (the table
                 comes back in the acknowledgement)

Each returns (ok, detail); the detail goes back in the acknowledgement. The
emitter calls :func:`run` as its ``on_command`` callback and knows nothing of
what the commands do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from breakpod import protocol
from breakpod._core import events
from breakpod._debug import debugger, park
from breakpod._debug.listener import Listener
from breakpod._job import boundary, watchdog
from breakpod._monitor.flight import table as flight_table

Result = tuple[bool, str]
MAX_DETAIL = 10_000


def run(name: str) -> Result:
    handler = HANDLERS.get(name)
    if handler is None:
        return False, f"this agent does not know the command {name!r}"
    try:
        return handler()
    except Exception as e:  # a command must never take the process down
        return False, f"{type(e).__name__}: {e}"


def do_break() -> Result:
    return True, boundary.request_break()


def do_resume() -> Result:
    if debugger.cancel_debugpy_wait():
        return True, "stopped waiting for a DAP client; the program continues"
    listener = debugger.active_pdb_listener()
    if listener is None:
        return False, "no debugger listener in this process: it is not parked"
    if listener.interrupt():
        return True, "stopped waiting for a debugger; the program continues"
    attached = park.attached_now()  # read before the hang-up ends its session
    if not listener.disconnect():
        return False, "not parked: nothing to resume"
    if attached is not None and attached.on_detach == "wait":  # it waits for the next client:
        _interrupt_next_wait(listener)  # end that wait too
    return True, "hung up on the attached debugger; the program continues"


def do_detach() -> Result:
    listener = debugger.active_pdb_listener()
    if listener is None or not listener.disconnect():
        return False, "no debugger is attached"
    return True, "hung up on the attached debugger"


def do_dump_stacks() -> Result:
    text = watchdog.format_stacks()
    events.emit(protocol.FALLBACK_KIND, message="stacks of every thread", stacks=text)
    return True, text[:MAX_DETAIL]  # the user's threads lead, breakpod's are folded last


def do_dump_flight() -> Result:
    # on demand: the recorder's module loads the monitors, which a link without a
    # watched model never needs (watch() has loaded it wherever a recorder exists)
    from breakpod._monitor.flight import recorder as flight

    fields = flight.dump_fields()
    if fields is None:
        return False, "no flight recorder: no model is watched (breakpod.watch) in this process"
    events.emit(
        protocol.FALLBACK_KIND, message="flight recorder", **{protocol.FLIGHT_FIELD: fields}
    )
    return True, "\n".join(flight_table.lines(fields))[-MAX_DETAIL:]


def _interrupt_next_wait(listener: Listener, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not listener.interrupt():
        time.sleep(0.05)


HANDLERS: dict[str, Callable[[], Result]] = {
    protocol.BREAK: do_break,
    protocol.RESUME: do_resume,
    protocol.DETACH: do_detach,
    protocol.DUMP_STACKS: do_dump_stacks,
    protocol.DUMP_FLIGHT: do_dump_flight,
}
