"""The broker API over HTTPS (BREAKPOD_TLS_CERT_FILE/KEY_FILE), and the agent's
client verifying it with BREAKPOD_BROKER_CA (a path, or the PEM text itself)."""

from __future__ import annotations

import pytest

from breakpod._core.errors import BrokerRequestError
from breakpod._link.client import ENV_CA, BrokerClient
from tests.brokerkit import AGENT, BrokerProcess, wait_until
from tests.deploy.test_webhook_tls import OPENSSL, make_certs


class TlsBroker(BrokerProcess):
    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"

    def _wait_ready(self, timeout: float) -> None:  # readiness is checked by the test
        pass


@pytest.fixture
def tls_broker(redis_url, tmp_path):
    if OPENSSL is None:
        pytest.skip("openssl not installed")
    ca, cert, key = make_certs(tmp_path)
    env = {"BREAKPOD_TLS_CERT_FILE": str(cert), "BREAKPOD_TLS_KEY_FILE": str(key)}
    broker = TlsBroker(redis_url, tmp_path / "broker.log", **env).start()
    yield broker, ca
    broker.stop()


def _whoami(url: str) -> object:
    try:
        return BrokerClient(url, AGENT, timeout=2).request("GET", "/v1/whoami")
    except BrokerRequestError as e:
        return e


def _answer(reply: object) -> object:
    return reply if isinstance(reply, dict) else None


def test_agents_verify_the_broker_with_its_ca(tls_broker, monkeypatch) -> None:
    broker, ca = tls_broker
    monkeypatch.setenv(ENV_CA, str(ca))
    me = wait_until(lambda: _answer(_whoami(broker.url)), timeout=20)
    assert me["role"] == "agent"
    monkeypatch.setenv(ENV_CA, ca.read_text())  # the PEM text, as a ConfigMap ref gives it
    assert isinstance(_whoami(broker.url), dict)
    monkeypatch.delenv(ENV_CA)  # the system's CAs do not know this one: refused
    refused = _whoami(broker.url)
    assert isinstance(refused, BrokerRequestError) and "CERTIFICATE_VERIFY_FAILED" in str(refused)


@pytest.mark.parametrize("ca", ["/nonexistent/ca.pem", "-----BEGIN CERTIFICATE-----\nnot one\n"])
def test_a_ca_bundle_that_cannot_be_read_is_said_as_such(monkeypatch, ca) -> None:
    """A missing BREAKPOD_BROKER_CA file read as 'cannot reach the broker ... is it
    running?': the broker needs no start here, the bundle is what is wrong."""
    monkeypatch.setenv(ENV_CA, ca)
    refused = _whoami("https://localhost:9")
    assert isinstance(refused, BrokerRequestError), refused
    assert str(refused).startswith(f"{ENV_CA}=") and "cannot be read as a CA bundle" in str(refused)
    assert "is it running" not in str(refused)
