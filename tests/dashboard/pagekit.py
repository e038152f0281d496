"""What the dashboard's browser tests share: logging in, polling the page, a real agent loop."""

from __future__ import annotations

import time
from typing import Any

from tests.brokerkit import ADMIN, AGENT, VIEWER, wait_until

# A training loop with a real agent: it registers, heartbeats, and parks at its
# next step boundary when an admin sends "break" through the broker.
LOOP = """
    import time
    import breakpod
    from breakpod._link import emitter
    from breakpod._core import events
    seen = []
    events.add_sink(lambda event: seen.append(event.kind))
    emitter.ensure_started()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "resumed" not in seen:
        time.sleep(0.01)
        breakpod.break_if_requested()
"""


def agent_env(
    broker: Any, rank: int, world_size: int = 2, job: str = "train-live"
) -> dict[str, str]:
    return {
        "BREAKPOD_BROKER_URL": broker.url,
        "BREAKPOD_AGENT_TOKEN": AGENT,
        "BREAKPOD_JOB": job,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
    }


def sessions(broker: Any, **query: Any) -> list[dict[str, Any]]:
    with broker.client(VIEWER) as c:
        return list(c.get("/v1/sessions", params=query).json()["sessions"])


def until(page: Any, expression: str, timeout: float = 15.0) -> Any:
    """Poll an expression (the page's CSP forbids the eval behind wait_for_function)."""
    return wait_until(lambda: page.evaluate(expression), timeout=timeout, interval=0.02)


def jobs_shown(page: Any, count: int) -> None:
    until(page, f"document.querySelectorAll('article.job').length === {count}")


def login(page: Any, broker: Any, token: str = VIEWER) -> float:
    started = time.perf_counter()
    page.goto(broker.url + "/")
    page.fill("#token", token)
    page.click("#login button[type=submit]")
    return started


def send(broker: Any, session_id: str, command: str) -> None:
    with broker.client(ADMIN) as c:
        sent = c.post(f"/v1/sessions/{session_id}/commands", json={"command": command})
        assert sent.status_code in (200, 201, 202), sent.text


def received(broker: Any, session_id: str, kind: str) -> float:
    with broker.client(VIEWER) as c:
        page = c.get("/v1/events", params={"session": session_id, "kind": kind}).json()
    return float(page["events"][-1]["received"])


def watch_state(page: Any, session_id: str, state: str, flag: str = "__parkedAt") -> None:
    """Record (Date.now, in window[flag]) when the rank's cell first reads ``state``,
    whatever re-renders it."""
    page.evaluate(
        """([id, state, flag]) => {
            const seen = () => {
                const cell = document.querySelector(`.rank[data-session="${id}"]`);
                if (cell && cell.dataset.state === state && !window[flag])
                    window[flag] = Date.now();
            };
            new MutationObserver(seen).observe(document.getElementById("jobs"),
                {childList: true, subtree: true, attributes: true});
        }""",
        [session_id, state, flag],
    )
