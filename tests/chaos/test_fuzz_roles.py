"""Schemathesis over the broker's OpenAPI with every role, its generated bodies
poisoned with NaN, infinities and nesting deeper than any limit: no 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.brokerkit import ADMIN, AGENT, VIEWER, post_events, register

SKIP = {"GET /v1/events/stream"}  # an endless SSE stream: tests/broker/test_api.py
ROLES = {
    "agent": (AGENT, None),
    "viewer": (VIEWER, None),
    "admin": (ADMIN, None),
    "agent-a": ("agent", ["team-a"]),
    "viewer-a": ("viewer", ["team-a"]),
    "admin-a": ("admin", ["team-a"]),
}
POISONS = ["nan", "inf", "deep", "deeper-than-the-parser"]


def _poisoned(body: Any, poison: str) -> str:
    """``body`` as JSON text with every number (or, for the deep ones, every
    value) replaced: Python's json writes NaN and Infinity as the agent's would."""
    if poison in ("nan", "inf"):
        text = json.dumps(_replace_numbers(body, float(poison)))
        return text if text != json.dumps(body) else json.dumps({"x": float(poison), "v": body})
    depth = 40 if poison == "deep" else 2000
    wrapped = "[" * depth + json.dumps(body) + "]" * depth
    if isinstance(body, dict) and body:
        return "{" + ", ".join(f"{json.dumps(k)}: {wrapped}" for k in body) + "}"
    return wrapped


def _replace_numbers(value: Any, number: float) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return number
    if isinstance(value, dict):
        return {k: _replace_numbers(v, number) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_numbers(v, number) for v in value]
    return value


def _token(broker, role: str) -> str:
    token, namespaces = ROLES[role]
    if namespaces is None:
        return token
    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": token, "namespaces": namespaces})
    return str(made.json()["token"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("role", list(ROLES))
def test_poisoned_fuzzed_requests_never_get_a_server_error(start_broker, role):
    broker = start_broker(BREAKPOD_MAX_POLL_SECONDS="0.05")
    register(broker, "s1", AGENT, namespace="team-a", address="127.0.0.1:5678")
    post_events(broker, {"id": "e1", "session": "s1", "kind": "log", "fields": {"x": 1}})
    with broker.client(ADMIN) as c:
        schema = schemathesis.openapi.from_dict(c.get("/openapi.json").json())
    headers = {"Authorization": f"Bearer {_token(broker, role)}"}
    failures: list[str] = []
    statuses: set[int] = set()
    with httpx.Client(timeout=15) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.label in SKIP:
                continue

            @settings(
                max_examples=6,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            @given(
                case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                poison=st.sampled_from(["none", *POISONS]),
            )
            def check(case, poison):
                sent = case.as_transport_kwargs(base_url=broker.url, headers=headers)
                body = sent.pop("json", None)
                if body is not None and poison != "none":
                    sent["content"] = _poisoned(body, poison)
                    sent["headers"] = {**sent["headers"], "content-type": "application/json"}
                elif body is not None:
                    sent["json"] = body
                response = client.request(
                    sent["method"],
                    sent["url"],
                    params=sent.get("params"),
                    headers=sent["headers"],
                    content=sent.get("content"),
                    json=sent.get("json"),
                )
                statuses.add(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{case.operation.label} [{poison}]: {response.text[:200]}")

            check()
    assert not failures, "\n".join(failures[:10])
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses
