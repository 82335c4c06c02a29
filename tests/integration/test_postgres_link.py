"""Every PostgreSQL connection carries link settings (connect timeout, TCP
keepalives, TCP user timeout) that its URI leaves unset, so a link that goes
silent fails within seconds instead of hanging a worker or the gateway; a
server that stops answering on a live link fails a call after
AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from agentdispatch import Submission
from agentdispatch.backends.postgres import db as pgdb
from agentdispatch.backends.postgres.db import LINK_DEFAULTS, PgDb, with_link_defaults
from agentdispatch.errors import TaskQueueUnavailable
from backends import pg_harness_at
from pg import BASE_URI, PrivateCluster


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


def test_a_paused_server_fails_a_submission_with_its_cause_and_the_pool_recovers() -> None:
    # Paused, the server's kernel keeps the link alive: no TCP timeout fires.
    cluster = PrivateCluster().start()
    h = pg_harness_at(cluster.uri(), cluster.destroy, pg_answer_timeout_s=2)
    try:
        d = h.dispatcher()
        d.submit(Submission(kind="echo", tenant="t"))
        pids = cluster.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TaskQueueUnavailable) as refused:
                d.submit(Submission(kind="echo", tenant="t", idempotency_key="while-paused"))
            waited = time.monotonic() - t0
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert 2 <= waited < 10, waited
        said = str(refused.value)
        assert "did not answer within 2 s" in said and "AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S" in said, said
        # The cut connection is gone from the pool: every submission works again.
        for i in range(5):
            d.submit(Submission(kind="echo", tenant="t", idempotency_key=f"after-{i}"))
        again = d.submit(Submission(kind="echo", tenant="t", idempotency_key="while-paused"))
        assert h.store.get(again.job_id, "t") is not None
    finally:
        h.close()
