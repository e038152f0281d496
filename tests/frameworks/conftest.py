"""Real frameworks on CPU: tiny random-init models, nothing downloaded."""

from __future__ import annotations

import os

import pytest

from tests.brokerkit import _shared_broker, broker, redis_server, redis_url  # noqa: F401

os.environ["HF_HUB_OFFLINE"] = "1"  # a test that tried to download fails at once
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _monitor_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BREAKPOD_MONITOR", "AI_DEBUG_MODE", "BREAKPOD_ON_EXPIRE", "ENABLE_REMOTE_DEBUG"):
        monkeypatch.delenv(name, raising=False)
