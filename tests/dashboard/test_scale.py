"""1,000 sessions and 10,000 events: the page's first render and a live update,
measured in real chromium against a real broker (printed; run with -s).

The bounds asserted are loose (a loaded 2-core machine); the numbers printed are
the measurement."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.brokerkit import AGENT, post_events
from tests.dashboard.pagekit import login, received, until, watch_state

JOBS, RANKS = 250, 4  # 1,000 sessions
EVENTS_PER_SESSION = 10  # 10,000 events
FIRST_RENDER_BOUND_S = 20.0
LIVE_BOUND_S = 2.0


def register_many(broker) -> list[str]:
    ids = []
    with httpx.Client(
        base_url=broker.url, headers={"Authorization": f"Bearer {AGENT}"}, timeout=30
    ) as c:
        for job in range(JOBS):
            for rank in range(RANKS):
                sid = f"scale-{job:03d}-{rank}"
                doc = {
                    "job": f"job-{job:03d}",
                    "namespace": f"team-{job % 5}",
                    "rank": rank,
                    "world_size": RANKS,
                    "pod": f"job-{job:03d}-worker-{rank}",
                }
                assert c.put(f"/v1/sessions/{sid}", json=doc).status_code == 200
                ids.append(sid)
    return ids


def post_history(broker, ids: list[str]) -> None:
    batch = []
    for sid in ids:
        for step in range(EVENTS_PER_SESSION):
            batch.append(
                {
                    "id": f"{sid}-{step}",
                    "session": sid,
                    "kind": "log",
                    "fields": {"step": step, "loss": 1.0 / (step + 1)},
                }
            )
            if len(batch) == 1000:
                assert post_events(broker, *batch).status_code == 200
                batch = []
    if batch:
        assert post_events(broker, *batch).status_code == 200


@pytest.mark.timeout(240)
def test_a_thousand_sessions_render_and_update_live(broker, page):
    ids = register_many(broker)
    post_history(broker, ids)

    started = login(page, broker)
    until(page, f"document.querySelectorAll('.rank').length === {len(ids)}", timeout=60)
    first = time.perf_counter() - started
    in_page = int(page.evaluate("document.documentElement.dataset.firstDataMs"))
    render_ms = page.evaluate(
        "(() => { const t = performance.now(); render(); return performance.now() - t; })()"
    )

    target = ids[len(ids) // 2]
    watch_state(page, target, "parked")
    parked = {
        "id": f"{target}-park",
        "session": target,
        "kind": "parked",
        "fields": {"reason": "scale test", "address": "127.0.0.1:5678"},
    }
    assert post_events(broker, parked).status_code == 200
    shown_at = until(page, "window.__parkedAt") / 1000
    live = shown_at - received(broker, target, "parked")
    assert page.get_attribute("article.job >> nth=0", "data-job") == target.rsplit("-", 1)[
        0
    ].replace("scale", "job")

    page.click(f".rank[data-session='{target}']")
    opened = time.perf_counter()
    page.wait_for_selector("#detail svg.plot[data-series=loss]")
    detail = time.perf_counter() - opened

    print(f"\n{len(ids)} sessions, {len(ids) * EVENTS_PER_SESSION} events:")
    print(f"  login -> every rank drawn: {first * 1000:.0f} ms ({in_page} ms in the page)")
    print(f"  one full re-render: {render_ms:.0f} ms")
    print(f"  event received -> parked on the page: {live * 1000:.0f} ms")
    print(f"  session view with its plot: {detail * 1000:.0f} ms")
    assert first < FIRST_RENDER_BOUND_S, first
    assert 0 <= live < LIVE_BOUND_S, live
