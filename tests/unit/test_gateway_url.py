"""The URL the gateway prints at start-up is one a person can paste."""

from __future__ import annotations

import httpx

from agentdispatch.cli.gateway import url_of


def test_an_ipv6_host_is_bracketed_and_the_url_parses() -> None:
    assert url_of("127.0.0.1", 8080) == "http://127.0.0.1:8080/"
    assert url_of("::1", 8080) == "http://[::1]:8080/"
    url = httpx.URL(url_of("::1", 8080))
    assert (url.host, url.port) == ("::1", 8080)
