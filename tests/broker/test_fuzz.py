"""Schemathesis fuzzes every operation of the broker's OpenAPI: no input gets a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.brokerkit import ADMIN, AGENT, register

SKIP = {"GET /v1/events/stream"}  # an endless SSE stream: covered in test_api


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mode", "limited"),
    [
        (GenerationMode.POSITIVE, False),
        (GenerationMode.NEGATIVE, False),
        (GenerationMode.POSITIVE, True),  # a namespace-limited admin takes other paths
    ],
)
def test_fuzzed_requests_never_get_a_server_error(start_broker, mode, limited):
    broker = start_broker(BREAKPOD_MAX_POLL_SECONDS="0.05")
    register(broker, "s1", AGENT, namespace="team-a")
    with broker.client(ADMIN) as c:
        schema = schemathesis.openapi.from_dict(c.get("/openapi.json").json())
        body = {"role": "admin", "namespaces": ["team-a"]}
        token = c.post("/v1/tokens", json=body).json()["token"] if limited else ADMIN
    headers = {"Authorization": f"Bearer {token}"}
    failures: list[str] = []
    statuses: set[int] = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in SKIP:
            continue

        @settings(
            max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=broker.url, headers=headers, timeout=10)
            statuses.add(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.operation.label}: {response.text[:200]}")

        try:
            check()
        except Unsatisfiable:  # negative mode: nothing in this operation can be made invalid
            assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n".join(failures[:10])
    # the token worked, and invalid input reached validation
    assert (200 if mode is GenerationMode.POSITIVE else 422) in statuses
