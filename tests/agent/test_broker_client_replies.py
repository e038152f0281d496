"""The broker client against URLs that are not the broker: bounded, clear errors."""

from __future__ import annotations

import http.server
from collections.abc import Iterator

import pytest

from breakpod._core.errors import BrokerRequestError
from breakpod._link.client import MAX_REPLY, BrokerClient
from tests.brokerkit import http_server


class Replies(http.server.BaseHTTPRequestHandler):
    """``/endless``: a 200 whose body never ends; ``/html``: a web page; any other path is
    echoed back as JSON (the path as the server received it)."""

    def do_GET(self) -> None:
        if self.path.startswith("/endless"):
            self.send_response(200)
            self.end_headers()
            chunk = b"x" * (1 << 20)
            try:
                for _ in range((MAX_REPLY >> 20) + 8):
                    self.wfile.write(chunk)
            except OSError:
                pass  # the client hung up, as it should
            return
        body = (
            b"<html>hi</html>"
            if self.path.startswith("/html")
            else b'{"path": "%s"}' % (self.path.encode())
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    with http_server(Replies) as url:
        yield url


@pytest.mark.timeout(60)
def test_a_reply_that_never_ends_is_cut_off(server):
    with pytest.raises(BrokerRequestError, match="is it the breakpod broker"):
        BrokerClient(f"{server}/endless", None).healthz()


@pytest.mark.timeout(30)
def test_a_reply_that_is_not_the_brokers_gets_an_error_not_a_type_error(server):
    client = BrokerClient(f"{server}/html", None)
    with pytest.raises(BrokerRequestError, match="other than the breakpod broker's reply"):
        client.sessions()
    with pytest.raises(BrokerRequestError, match="other than the breakpod broker's reply"):
        BrokerClient(server, None).events()  # JSON, but without "events"


@pytest.mark.timeout(30)
def test_session_ids_are_one_path_segment(server):
    client = BrokerClient(server, None)
    assert client.session("a#b?c=1/ü")["path"] == "/v1/sessions/a%23b%3Fc%3D1%2F%C3%BC"
    with pytest.raises(BrokerRequestError, match="empty session id"):
        client.session("")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1", "http://a..b:1"]
)
def test_a_malformed_url_is_refused_with_what_is_expected(url):
    with pytest.raises(BrokerRequestError, match=r"is not http\(s\)://HOST\[:PORT\]"):
        BrokerClient(url, None)


def test_a_token_the_http_header_cannot_carry_is_refused():
    with pytest.raises(BrokerRequestError, match="non-ASCII"):
        BrokerClient("http://127.0.0.1:9", "tökén€€€€€€")


@pytest.mark.timeout(30)
def test_an_event_stream_from_a_server_that_never_answers_times_out(monkeypatch):
    """``breakpod events -f`` against a port that accepts and says nothing hung for ever."""
    import socket

    from breakpod._link import client as broker_client

    monkeypatch.setattr(broker_client, "STREAM_SILENCE", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        client = BrokerClient(f"http://127.0.0.1:{silent.getsockname()[1]}", None, timeout=1.0)
        with pytest.raises(BrokerRequestError, match="timed out"):
            next(client.event_stream())


def test_a_job_whose_ranks_all_ended_is_named_so_not_unknown():
    from breakpod._cli.broker import job_sessions

    ended = [{"id": "a", "job": "j1", "state": "finished", "rank": 0}]
    with pytest.raises(BrokerRequestError, match="job 'j1' has no running rank"):
        job_sessions(ended, "j1")  # was: "no session or running job 'j1'; jobs ... : j1"
    with pytest.raises(BrokerRequestError, match="jobs the broker knows: j1"):
        job_sessions(ended, "j2")
