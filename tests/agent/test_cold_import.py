"""A cold ``breakpoint()`` imports only what parking needs: without a broker
configured, nothing of the broker link, the process's identity or its hosting."""

from __future__ import annotations

import json

# Loaded only for a broker (the emitter, its HTTP client, who this process is,
# which container runtime hosts it) or for a job of several ranks.
NOT_FOR_A_PARK = (
    "breakpod._link",
    "breakpod._core.identity",
    "breakpod._core.hosting",
    "breakpod._core.notice",
    "breakpod._job",
    "breakpod._monitor",
    "http.client",
    "urllib.request",
    "secrets",
)

PARKS_AND_LISTS = """
    import json, sys
    breakpoint()
    print(json.dumps(sorted(sys.modules)))
"""


def loaded_after_a_park(spawn, **env: str) -> list[str]:
    env = {"BREAKPOD_HOLD_SECONDS": "0", **env}
    child = spawn(PARKS_AND_LISTS, env=env, stdin="closed")
    assert child.wait() == 0, child.stderr
    assert "nobody attached within 0s; continuing" in child.stderr
    return list(json.loads(child.stdout()))


def unneeded(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(f"{n}.") for n in NOT_FOR_A_PARK)]


def test_a_park_without_a_broker_imports_nothing_of_the_broker_link(spawn):
    assert unneeded(loaded_after_a_park(spawn)) == []


def test_with_a_broker_configured_the_park_starts_the_link(spawn):
    """The other side: the same park does load the link when a broker is set (so the
    test above can tell), and the job still continues with the broker unreachable."""
    modules = loaded_after_a_park(spawn, BREAKPOD_BROKER_URL="http://127.0.0.1:9")
    assert "breakpod._link.emitter" in modules and "breakpod._core.identity" in modules
