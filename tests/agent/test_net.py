"""Addresses: what breakpod prints is what `breakpod attach` reads back."""

from __future__ import annotations

import pytest

from breakpod._core import net


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [("127.0.0.1", 5678, "127.0.0.1:5678"), ("::1", 5679, "[::1]:5679")],
)
def test_format_and_parse_address_round_trip(host, port, text):
    assert net.format_address(host, port) == text
    assert net.parse_address(text) == (host, port)


def test_a_wildcard_bind_is_reached_on_loopback():
    assert net.local_address("0.0.0.0", 5678) == "127.0.0.1:5678"
    assert net.local_address("10.0.0.7", 5678) == "10.0.0.7:5678"
