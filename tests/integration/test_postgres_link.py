"""Every PostgreSQL connection carries link settings (connect timeout, TCP
keepalives, TCP user timeout) that its URI leaves unset, so a link that goes
silent fails within seconds instead of hanging a worker or the gateway."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import psycopg
import pytest

from agentdispatch.backends.postgres import db as pgdb
from agentdispatch.backends.postgres.db import LINK_DEFAULTS, PgDb, with_link_defaults
from pg import BASE_URI


def test_the_uri_keeps_what_it_sets_and_gets_the_rest() -> None:
    got = psycopg.conninfo.conninfo_to_dict(with_link_defaults(f"{BASE_URI}?tcp_user_timeout=2500&keepalives=0"))
    assert got["tcp_user_timeout"] == "2500" and got["keepalives"] == "0"
    assert got["connect_timeout"] == str(LINK_DEFAULTS["connect_timeout"])
    assert got["keepalives_idle"] == str(LINK_DEFAULTS["keepalives_idle"])
    assert (
        psycopg.conninfo.conninfo_to_dict(with_link_defaults(f"{BASE_URI}?connect_timeout=3"))["connect_timeout"] == "3"
    )
    assert with_link_defaults("not a uri =") == "not a uri ="


def test_pooled_connections_use_the_link_settings() -> None:
    db = PgDb(BASE_URI, max_size=2)
    try:
        with db.pool.connection(timeout=10) as conn:
            params = conn.info.get_parameters()
    finally:
        db.close()
    assert params["tcp_user_timeout"] == str(LINK_DEFAULTS["tcp_user_timeout"])
    assert params["keepalives_count"] == str(LINK_DEFAULTS["keepalives_count"])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose kernel completes the TCP handshake and then nothing ever
    answers: a server that hangs, or a link that went dead after connect."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        yield srv.getsockname()[1]


def test_a_connect_to_a_silent_server_gives_up(monkeypatch: pytest.MonkeyPatch, silent_port: int) -> None:
    # The mechanism, with a short timeout so the test stays quick.
    monkeypatch.setitem(pgdb.LINK_DEFAULTS, "connect_timeout", 2)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            psycopg.connect(with_link_defaults(f"postgresql://postgres@127.0.0.1:{silent_port}/test")).close()
            outcome.append(None)
        except psycopg.OperationalError as exc:
            outcome.append(exc)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the connect to a silent server never gave up"
    assert isinstance(outcome[0], psycopg.OperationalError), outcome
