"""Kafka liveness against a real broker (Tansu): a session's eligible turn is
found however its messages are ordered in the partition, and turns that
cannot run do not fill the fetch buffer."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from agentdispatch import Status, Submission
from agentdispatch.backends.kafka.transport import KafkaTransport
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.dispatch import Dispatcher
from agentdispatch.envelope import Envelope
from agentdispatch.handlers import Registry
from agentdispatch.settings import Settings, load_settings
from agentdispatch.transports.base import Delivery
from kafka_broker import Broker

FAST = {"max_poll_interval_ms": 10_000, "session_timeout_ms": 6_000, "timeout_s": 3.0}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.kill()


def _settings(tmp: Path, bootstrap: str, **kw: Any) -> Settings:
    return load_settings(task_queue_backend="kafka", kafka_bootstrap_servers=bootstrap, data_dir=tmp / "data", **kw)


def _env(job: str, session: str) -> Envelope:
    return Envelope(job_id=job, session_id=session, kind="echo", payload_ref=job, tenant="t", enqueued_at=0.0)


def _get(transport: KafkaTransport, owner: str, timeout: float = 15.0) -> Delivery | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = transport.get(owner, visibility_s=30, wait_s=0.2)
        if got is not None:
            return got
    return None


def _job(d: Delivery | None) -> str | None:
    return None if d is None else Envelope.from_json(d.raw).job_id


def test_a_retry_behind_its_sessions_later_turns_is_handed_out_first(tmp_path: Path, broker: Broker) -> None:
    transport = KafkaTransport(_settings(tmp_path, broker.bootstrap, agent_turns_partitions=1), buffer_max=2, **FAST)
    try:
        # Session s: turns 2..9 first, then the retry of turn 1 at the tail (as a
        # failed first attempt is re-published), then one turn of session o.
        envs = [_env(f"s{i}", "s") for i in range(2, 10)] + [_env("s1", "s"), _env("o1", "o")]
        transport.put_many(envs, [*range(2, 10), 1, 100])
        first = _get(transport, "a:0")
        assert _job(first) == "s1", "the session's earliest turn was not the one handed out"
        assert first is not None
        transport.release(first, 30.0)  # busy (in backoff): the whole session waits
        # Session o's turn sits behind eight waiting turns of s, more than the buffer holds.
        other = _get(transport, "a:0")
        assert _job(other) == "o1", "a session's waiting turns starved another session"
        assert other is not None and transport.ack(other)
        assert transport.get("a:0", visibility_s=30, wait_s=0.5) is None  # s waits for s1
    finally:
        transport.close()


def test_a_full_buffer_stops_taking_messages_without_pausing_while_it_drains(tmp_path: Path, broker: Broker) -> None:
    """Pausing a partition makes the client drop what it fetched (and fetch
    it again on resume); a buffer that drains steadily must not pause. One that
    stays full pauses, so that its polls keep it in the group."""
    transport = KafkaTransport(
        _settings(tmp_path, broker.bootstrap, agent_turns_partitions=1), buffer_max=4, keepalive_s=0.5, **FAST
    )
    try:
        transport.put_many([_env(f"j{i}", f"s{i}") for i in range(40)])
        got = [_get(transport, "a:0") for _ in range(40)]
        assert all(d is not None for d in got)
        assert sorted(_job(d) or "" for d in got) == sorted(f"j{i}" for i in range(40))
        consumer = transport._consumers["a:0"]
        assert consumer.stats()["pauses"] == 0, "a steadily drained buffer paused its partitions"
        # The owner takes nothing more (its 40 turns run): the keepalive polls
        # for it, fills the buffer, then pauses rather than take more.
        transport.put_many([_env(f"k{i}", f"t{i}") for i in range(8)])
        deadline = time.monotonic() + 15
        while consumer.stats()["pauses"] == 0:
            assert time.monotonic() < deadline, "a full buffer was never paused for its liveness polls"
            time.sleep(0.05)
        assert consumer.stats()["buffered"] == 4
        assert consumer.stats()["revocations"] == 0
    finally:
        transport.close()


def test_failed_first_attempts_do_not_livelock_a_small_buffer(tmp_path: Path, broker: Broker) -> None:
    from agentdispatch.worker import Worker, WorkerOptions

    settings = _settings(tmp_path, broker.bootstrap, agent_turns_partitions=1, claim_ttl_s=5, renew_interval_s=1)
    store = SqliteStore(settings.sqlite_path, extra_attempts=settings.max_attempts)
    store.migrate()
    transport = KafkaTransport(settings, buffer_max=4, **FAST)
    ran: dict[str, list[int]] = {}
    lock = threading.Lock()

    def flaky(turn: Any, guard: Any) -> str:
        with lock:
            ran.setdefault(turn.session_id, []).append(turn.payload["i"])
        if turn.payload["i"] % 5 == 0 and turn.attempt == 1:
            raise RuntimeError("transient")
        return "ok"

    reg = Registry()
    reg.add("flaky", flaky)
    worker = Worker(settings, store, transport, reg, options=WorkerOptions(threads=1, get_wait_s=0.05))
    worker.start()
    try:
        d = Dispatcher(store, transport, settings)
        subs = [Submission(kind="flaky", tenant="t", session_id=f"s{i % 3}", payload={"i": i}) for i in range(45)]
        handles = d.submit_many(subs)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if all(store.get(h.job_id, None).status.terminal for h in handles):
                break
            time.sleep(0.2)
    finally:
        worker.stop(grace_s=5)
        transport.close()
    statuses = [store.get(h.job_id, None).status for h in handles]
    store.close()
    assert statuses.count(Status.SUCCEEDED) == len(handles), f"unfinished: {statuses}"
    for session, order in ran.items():
        firsts = list(dict.fromkeys(order))  # each turn's first run, in run order
        assert firsts == sorted(firsts), f"session {session} ran out of order: {order}"


def test_submit_many_answers_with_handles_when_the_broker_dies_after_the_commit(tmp_path: Path, broker: Broker) -> None:
    import contextlib

    from agentdispatch.errors import TaskQueueUnavailable
    from agentdispatch.reconciler import reconcile_once

    class BrokerDiesAfterCommit(SqliteStore):
        def submit(self, jobs: Any, **kw: Any) -> Any:
            accepted = super().submit(jobs, **kw)
            broker.kill()  # the rows are durable; the publish will find no broker
            return accepted

    settings = _settings(tmp_path, broker.bootstrap, agent_turns_partitions=2)
    store = BrokerDiesAfterCommit(settings.sqlite_path, extra_attempts=settings.max_attempts)
    store.migrate()
    transport = KafkaTransport(settings, **{**FAST, "timeout_s": 2.0})
    result: list[Any] = []

    def submit() -> None:
        try:
            result.append(
                Dispatcher(store, transport, settings).submit_many(
                    [Submission(kind="echo", tenant="t", session_id=f"s{i}") for i in range(20)]
                )
            )
        except Exception as exc:  # the assertion below names it
            result.append(exc)

    try:
        caller = threading.Thread(target=submit, daemon=True)
        caller.start()
        caller.join(120)
        assert result, "submit_many hung with the broker gone"
        handles = result[0]
        assert isinstance(handles, list) and len(handles) == 20, f"no handles: {handles!r}"
        assert len(store.outbox_take(100)) == 20  # stored, waiting for the reconciler
        broker.start()  # same port, empty log
        deadline = time.monotonic() + 60
        while store.outbox_take(1) and time.monotonic() < deadline:
            with contextlib.suppress(TaskQueueUnavailable):
                reconcile_once(store, transport)
            time.sleep(0.2)
        got: set[str] = set()
        while len(got) < 20 and time.monotonic() < deadline:
            d = transport.get("a:0", visibility_s=30, wait_s=0.2)
            if d is not None:
                got.add(Envelope.from_json(d.raw).job_id)
                transport.ack(d)
        assert got == {h.job_id for h in handles}
    finally:
        transport.close()
        store.close()
