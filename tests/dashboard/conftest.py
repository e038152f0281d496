"""Fixtures for the dashboard: a real broker and Redis, and Debian's chromium
driven by Playwright (its own browser download is not reachable here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.brokerkit import (  # noqa: F401
    _shared_broker,
    broker,
    redis_server,
    redis_url,
    start_broker,
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


# One browser per test module, not per session: Playwright's sync API keeps its event loop
# running in this thread while it is open, so a later asyncio.run() on the same
# pytest-xdist worker (a broker test's) failed with "cannot be called from a running
# event loop".
@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="pip install -r requirements-dev.txt (playwright)"
    )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    """A fresh tab in its own context (its own sessionStorage)."""
    context = chromium.new_context()
    context.set_default_timeout(15_000)
    tab = context.new_page()
    said: list[str] = []  # printed when a test fails: the page's own errors
    tab.on("console", lambda message: said.append(f"console.{message.type}: {message.text}"))
    tab.on("pageerror", lambda error: said.append(f"page error: {error}"))
    yield tab
    print("\n".join(said))
    context.close()
