"""Dashboard logins against a real broker and Redis: a token typed once becomes an
HttpOnly, SameSite=Strict cookie; a state-changing request with that cookie needs its
CSRF token; logging out, revoking the token or the login's expiry ends it."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import redis
from pydantic import ValidationError

from breakpod_broker import proxies
from breakpod_broker.settings import BrokerSettings
from tests.brokerkit import ADMIN, AGENT, VIEWER, register, wait_until

CSRF = "X-CSRF-Token"
_clients: list[httpx.Client] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _clients:
        _clients.pop().close()


def logged_in(broker, token: str) -> tuple[httpx.Client, dict]:
    """A client without any bearer header, logged in through the form's route (closed
    at the test's end)."""
    client = httpx.Client(base_url=broker.url, timeout=10)
    _clients.append(client)
    answer = client.post("/v1/login", json={"token": token})
    assert answer.status_code == 200, answer.text
    return client, answer.json()


def test_login_sets_an_httponly_strict_cookie_that_opens_the_api(broker):
    client, info = logged_in(broker, VIEWER)
    cookie = client.cookies.jar
    (only,) = list(cookie)
    assert only.name == "breakpod_login" and only.path == "/"
    header = client.post("/v1/login", json={"token": VIEWER}).headers["set-cookie"].lower()
    assert "httponly" in header and "samesite=strict" in header and "max-age=43200" in header
    assert "secure" not in header  # plain http here; https requests get Secure
    assert info["role"] == "viewer" and len(info["csrf"]) >= 32
    assert client.get("/v1/sessions").status_code == 200
    again = client.get("/v1/login").json()  # a reloaded page asks for its CSRF token
    assert again["role"] == "viewer"


def test_a_state_changing_request_with_the_cookie_needs_the_csrf_token(broker):
    register(broker, "s-csrf", namespace="team-a")
    client, info = logged_in(broker, ADMIN)
    path, body = "/v1/sessions/s-csrf/commands", {"command": "break"}
    missing = client.post(path, json=body)
    assert missing.status_code == 403 and CSRF in missing.json()["detail"]
    wrong = client.post(path, json=body, headers={CSRF: info["csrf"][:-1] + "x"})
    assert wrong.status_code == 403
    other, other_info = logged_in(broker, ADMIN)  # another login's token is no better
    other.close()
    assert client.post(path, json=body, headers={CSRF: other_info["csrf"]}).status_code == 403
    assert client.post(path, json=body, headers={CSRF: info["csrf"]}).status_code == 202
    with broker.client(VIEWER) as c:  # only the one accepted command was queued
        events = c.get("/v1/events", params={"session": "s-csrf", "kind": "command"}).json()
    assert len({e["fields"]["command_id"] for e in events["events"]}) == 1


def test_agent_and_unknown_tokens_cannot_log_in(broker):
    with httpx.Client(base_url=broker.url, timeout=10) as c:
        agent = c.post("/v1/login", json={"token": AGENT})
        assert agent.status_code == 403 and "agent token may not log in" in agent.text
        assert c.post("/v1/login", json={"token": "unknown-token-1"}).status_code == 401
        assert c.post("/v1/login", json={"token": ""}).status_code == 422
        assert c.post("/v1/login", json={"token": "x" * 5000}).status_code == 422
        assert "set-cookie" not in agent.headers
        assert c.get("/v1/login").status_code == 401
        c.cookies.set("breakpod_login", "forged-cookie-value")
        ended = c.get("/v1/sessions")
        assert ended.status_code == 401 and "login has ended" in ended.text


def test_logout_and_revoking_the_token_end_the_login(broker):
    client, info = logged_in(broker, VIEWER)
    cookie = client.cookies["breakpod_login"]
    assert client.post("/v1/logout").status_code == 403  # it changes something: CSRF
    out = client.post("/v1/logout", headers={CSRF: info["csrf"]})
    assert out.status_code == 204 and "max-age=0" in out.headers["set-cookie"].lower()
    with httpx.Client(base_url=broker.url, cookies={"breakpod_login": cookie}) as replay:
        assert replay.get("/v1/sessions").status_code == 401  # the old cookie is dead

    with broker.client(ADMIN) as admin:
        made = admin.post("/v1/tokens", json={"role": "viewer"}).json()
    client, _ = logged_in(broker, made["token"])
    assert client.get("/v1/sessions").status_code == 200
    with broker.client(ADMIN) as admin:
        assert admin.delete(f"/v1/tokens/{made['id']}").status_code == 204
    assert client.get("/v1/sessions").status_code == 401


def test_redis_holds_no_usable_cookie_and_logins_expire(start_broker):
    short = start_broker(BREAKPOD_LOGIN_SECONDS="60")
    client, _ = logged_in(short, VIEWER)
    cookie = client.cookies["breakpod_login"]
    r = redis.Redis.from_url(short.redis_url, decode_responses=True)
    keys = r.keys("breakpod:login:*")
    assert keys and all(cookie not in k and cookie not in (r.get(k) or "") for k in keys)
    assert 0 < r.ttl(keys[0]) <= 60
    r.pexpire(keys[0], 1)  # what 60 s would do
    wait_until(lambda: client.get("/v1/sessions").status_code == 401, timeout=5)


@pytest.mark.timeout(60)
def test_an_event_stream_opened_by_a_login_ends_when_the_login_does(broker):
    client, info = logged_in(broker, VIEWER)
    cookie = client.cookies["breakpod_login"]
    reader = httpx.Client(base_url=broker.url, cookies={"breakpod_login": cookie}, timeout=30)
    _clients.append(reader)
    with reader.stream("GET", "/v1/events/stream") as stream:
        assert stream.status_code == 200
        assert client.post("/v1/logout", headers={CSRF: info["csrf"]}).status_code == 204
        started = time.monotonic()
        for _ in stream.iter_bytes():
            pass  # comments and keep-alives until the broker ends it
        assert time.monotonic() - started < 15


def login_cookie(broker, source: str, **headers: str) -> str:
    """The Set-Cookie of a login sent from the local address ``source``."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=broker.url, transport=transport, timeout=10) as client:
        answer = client.post("/v1/login", json={"token": VIEWER}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.headers["set-cookie"].lower()


HTTPS = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}


def test_behind_a_trusted_tls_proxy_the_login_cookie_is_secure(start_broker):
    """The proxy terminates TLS and says so in X-Forwarded-Proto; only a peer listed in
    BREAKPOD_TRUSTED_PROXIES is believed (a proxy on 127.0.0.2 was not, whatever the
    setting: the cookie went out without Secure)."""
    broker = start_broker(BREAKPOD_TRUSTED_PROXIES="10.42.0.0/16, 127.0.0.2")
    assert "secure" in login_cookie(broker, "127.0.0.2", **HTTPS)
    assert "secure" not in login_cookie(broker, "127.0.0.2")  # plain http through it
    assert "secure" not in login_cookie(broker, "127.0.0.1", **HTTPS)  # not a listed proxy


def test_without_trusted_proxies_nobody_is_believed(broker):
    """Empty (the default): forwarded headers are ignored, also from 127.0.0.1 (which
    the server believed on its own)."""
    assert "secure" not in login_cookie(broker, "127.0.0.1", **HTTPS)


def test_a_trusted_proxy_that_is_not_an_address_stops_the_broker_with_its_name():
    bad = re.escape("'10.42.0.0/66' is not an IP address or CIDR")
    with pytest.raises(ValidationError, match=bad):
        BrokerSettings(trusted_proxies="127.0.0.1,10.42.0.0/66")


@pytest.mark.parametrize(
    ("forwarded", "client"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("6.6.6.6, 203.0.113.7, 10.42.3.4", "203.0.113.7"),  # the left-most is anyone's word
        ("10.42.0.9", "10.42.0.9"),
    ],
)
def test_the_client_is_the_right_most_hop_that_is_not_a_trusted_proxy(forwarded, client):
    assert proxies.client_of(forwarded, proxies.parse("10.42.0.0/16")) == client
