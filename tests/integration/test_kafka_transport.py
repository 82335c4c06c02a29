"""The Kafka transport against a real Kafka-protocol broker (Tansu): flush
coalescing, lag admission, start-up failures, grow-only topics, receipts,
delivery failures healed by the relay, and turns longer than
``max.poll.interval.ms``."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

import contextlib

from agentdispatch import QueueFull, Status, Submission
from agentdispatch.backends.kafka.transport import KafkaTransport
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.dispatch import Dispatcher
from agentdispatch.envelope import Envelope, new_job_id
from agentdispatch.errors import DepthUnavailable, TaskQueueUnavailable
from agentdispatch.handlers import Registry
from agentdispatch.reconciler import reconcile_once
from agentdispatch.settings import Settings, load_settings
from agentdispatch.stores.base import NewJob
from agentdispatch.transports.base import Delivery, Receipt
from agentdispatch.worker import Worker, WorkerOptions
from kafka_broker import Broker
from ports import free_port

FAST = {"max_poll_interval_ms": 10_000, "session_timeout_ms": 6_000}


class Env:
    """A broker, a SQLite store and transports built on demand."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.broker = Broker(tmp / "broker").start()
        self.closers: list[Callable[[], None]] = []
        self.store: SqliteStore | None = None

    def settings(self, **kw: Any) -> Settings:
        return load_settings(
            task_queue_backend="kafka",
            kafka_bootstrap_servers=kw.pop("bootstrap", self.broker.bootstrap),
            data_dir=self.tmp / "data",
            **kw,
        )

    def open(self, settings: Settings, **kw: Any) -> tuple[SqliteStore, KafkaTransport]:
        if self.store is None:
            self.store = SqliteStore(settings.sqlite_path, extra_attempts=settings.max_attempts)
            self.store.migrate()
            self.closers.append(self.store.close)
        transport = KafkaTransport(settings, **{**FAST, **kw})
        self.closers.append(transport.close)
        return self.store, transport

    def close(self) -> None:
        for fn in reversed(self.closers):
            fn()
        self.broker.kill()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.close()


def _env(i: int) -> Envelope:
    return Envelope(
        job_id=f"job-{i}", session_id=f"s-{i}", kind="echo", payload_ref=f"job-{i}", tenant="t", enqueued_at=0.0
    )


def _drain(transport: KafkaTransport, n: int, owner: str = "c:0", timeout: float = 20.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        d = transport.get(owner, visibility_s=30, wait_s=0.2)
        if d is not None:
            got.append(d)
    return got


def test_concurrent_puts_share_one_flush_and_put_many_is_one_flush(env: Env) -> None:
    _, transport = env.open(env.settings(), linger_s=0.3)
    n = 24
    barrier = threading.Barrier(n)
    before = transport.stats()["flushes"]

    def put(i: int) -> None:
        barrier.wait()
        transport.put(_env(i))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert transport.stats()["flushes"] - before == 1
    transport.put_many([_env(100), _env(101), _env(102)])
    assert transport.stats()["flushes"] - before == 2
    got = _drain(transport, n + 3)
    assert sorted(Envelope.from_json(d.raw).job_id for d in got) == sorted(
        [f"job-{i}" for i in range(n)] + ["job-100", "job-101", "job-102"]
    )


def test_admission_at_the_lag_bound_rejects_and_produces_nothing(env: Env) -> None:
    settings = env.settings(max_depth=3)
    store, transport = env.open(settings)
    d = Dispatcher(store, transport, settings)
    jobs = [d.submit(Submission(kind="echo", tenant="t")) for _ in range(3)]
    assert transport.depth() == 3
    sent = transport.stats()["messages"]
    with pytest.raises(QueueFull, match="AGENT_DISPATCH_MAX_DEPTH=3"):
        transport.admit(1, 3)
    with pytest.raises(QueueFull):
        d.submit(Submission(kind="echo", tenant="t", job_id="one-too-many"))
    assert transport.stats()["messages"] == sent and transport.depth() == 3
    assert sum(store.counts(None).values()) == 3
    transport.admit(1, 4)  # below the bound: accepted
    # Consume and acknowledge one (its turn done): the lag drops, a submit fits.
    first = _drain(transport, 1)[0]
    c = store.claim(Envelope.from_json(first.raw).job_id, "t", owner="w", ttl_s=30)
    assert c.lease is not None
    from agentdispatch.workitem import Outcome

    store.commit(c.lease, Outcome(ok=True))
    assert transport.ack(first) is True
    deadline = time.monotonic() + 10
    while transport.depth() != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert transport.depth() == 2
    d.submit(Submission(kind="echo", tenant="t", job_id="fits-now"))
    assert transport.depth() == 3 and len(jobs) == 3


def test_depth_probe_failure_rejects_never_reads_zero(env: Env) -> None:
    settings = env.settings()
    store, transport = env.open(settings, timeout_s=2.0)
    assert transport.depth() == 0
    env.broker.kill()
    with pytest.raises(DepthUnavailable):
        transport.depth()
    with pytest.raises(DepthUnavailable):
        Dispatcher(store, transport, settings).submit(Submission(kind="echo", tenant="t"))
    assert sum(store.counts(None).values()) == 0


def test_unreachable_broker_fails_start_up_without_echoing_the_endpoint(env: Env) -> None:
    port = free_port()
    settings = env.settings(bootstrap=f"127.0.0.1:{port}")
    with pytest.raises(TaskQueueUnavailable) as info:
        KafkaTransport(settings, timeout_s=2.0)
    text = str(info.value)
    assert "KAFKA_BOOTSTRAP_SERVERS" in text and str(port) not in text and "127.0.0.1" not in text


def test_topic_is_grow_only_and_a_broker_that_cannot_grow_says_so(env: Env) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": env.broker.bootstrap})
    admin.create_topics([NewTopic("agent_turns", num_partitions=2, replication_factor=1)])["agent_turns"].result(10)
    with pytest.raises(TaskQueueUnavailable) as info:
        KafkaTransport(env.settings(agent_turns_partitions=6), timeout_s=5.0)
    text = str(info.value)
    assert "AGENT_TURNS_PARTITIONS=6" in text and "2 partition" in text and env.broker.bootstrap not in text
    # Fewer wanted than present: fine, never shrunk.
    _, transport = env.open(env.settings(agent_turns_partitions=1))
    assert transport.partitions == 2
    transport.ping()


def test_fresh_broker_gets_the_topic_with_the_configured_partitions(env: Env) -> None:
    _, transport = env.open(env.settings(agent_turns_partitions=5))
    assert transport.partitions == 5
    transport.ping()


def test_receipt_names_its_owner_and_a_foreign_receipt_is_refused(env: Env) -> None:
    settings = env.settings()
    store, transport = env.open(settings)
    Dispatcher(store, transport, settings).submit(Submission(kind="echo", tenant="t"))
    mine = _drain(transport, 1, owner="a:0")[0]
    assert mine.receipt.owner == "a:0"
    forged = Delivery(mine.raw, Receipt("b:0", mine.receipt.claimed_at, mine.receipt.ref))
    stranger = Delivery(mine.raw, Receipt("nobody:0", mine.receipt.claimed_at, mine.receipt.ref))
    stale = Delivery(mine.raw, Receipt("a:0", mine.receipt.claimed_at + 1, mine.receipt.ref))
    assert transport.ack(forged) is False
    assert transport.ack(stranger) is False
    assert transport.ack(stale) is False
    assert transport.ack(mine) is True
    assert transport.ack(mine) is False  # once


def test_ack_many_commits_a_batch_in_any_order_and_refuses_stale_receipts(env: Env) -> None:
    settings = env.settings(agent_turns_partitions=2)
    _store, transport = env.open(settings)
    transport.put_many([_env(i) for i in range(6)])
    got = _drain(transport, 6)
    assert len(got) == 6
    stale = Delivery(got[0].raw, Receipt("c:0", got[0].receipt.claimed_at + 1, got[0].receipt.ref))
    # Out of order, with a stale receipt among them: it alone is refused.
    assert transport.ack_many([*reversed(got[3:]), stale]) == [True, True, True, False]
    assert transport.ack_many([*got[:3], got[4]]) == [True, True, True, False]  # got[4]: acked already
    # Nothing is left unacknowledged: the commit points reached the ends of both partitions.
    deadline = time.monotonic() + 15
    while transport.depth() != 0:
        assert time.monotonic() < deadline, f"lag {transport.depth()} after every message was acknowledged"
        time.sleep(0.05)


def test_delivery_failure_raises_to_the_caller_and_the_item_is_healed(env: Env) -> None:
    settings = env.settings()
    store, transport = env.open(settings, timeout_s=2.0)
    d = Dispatcher(store, transport, settings)
    transport.admit(1, settings.max_depth)
    env.broker.kill()
    # The Dispatcher's sequence after admission: the store commit, then the relay.
    from agentdispatch.dispatch import validate

    job = validate(Submission(kind="echo", tenant="t"), max_attempts=5, known_kinds=None)
    store.submit([job], max_depth=settings.max_depth)
    with pytest.raises(TaskQueueUnavailable):
        transport.relay(store)
    assert store.get(job.job_id, "t").status is Status.READY and len(store.outbox_take(10)) == 1
    env.broker.start()  # same port, empty log
    deadline = time.monotonic() + 30
    while store.outbox_take(10) and time.monotonic() < deadline:
        with contextlib.suppress(TaskQueueUnavailable):
            reconcile_once(store, transport)
        time.sleep(0.2)
    assert store.outbox_take(10) == []
    got = _drain(transport, 1)
    assert [Envelope.from_json(g.raw).job_id for g in got] == [job.job_id]
    assert d.status(job.job_id, "t")["status"] == "ready"


def test_turn_longer_than_max_poll_interval_runs_once_without_rebalance(env: Env) -> None:
    settings = env.settings(claim_ttl_s=30, renew_interval_s=5)
    store, transport = env.open(settings, max_poll_interval_ms=6_000, session_timeout_ms=6_000)
    runs: list[str] = []
    lock = threading.Lock()

    def handler(turn: Any, guard: Any) -> str:
        with lock:
            runs.append(turn.job_id)
        time.sleep(float(turn.payload["sleep"]))
        return "ok"

    reg = Registry()
    reg.add("work", handler)
    worker = Worker(settings, store, transport, reg, options=WorkerOptions(threads=2, get_wait_s=0.05, heartbeat_s=1))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while transport.stats()["assignments"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(4)  # let the group settle after both members joined
        settled = transport.stats()
        d = Dispatcher(store, transport, settings)
        long = d.submit(Submission(kind="work", tenant="t", payload={"sleep": 9}))
        short = [d.submit(Submission(kind="work", tenant="t", payload={"sleep": 0})) for _ in range(10)]
        every = [long, *short]
        deadline = time.monotonic() + 60
        while not all(store.get(h.job_id, None).status.terminal for h in every) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop(grace_s=5)
    after = transport.stats()
    assert {store.get(h.job_id, None).status for h in every} == {Status.SUCCEEDED}
    assert sorted(runs) == sorted(h.job_id for h in every)  # each exactly once
    assert after["revocations"] == settled["revocations"], "a long turn caused a rebalance"
    assert after["handoffs"] == 0


def _until(done: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return done()


def test_a_worker_runs_ready_turns_from_the_store_while_the_group_cannot_deliver(env: Env) -> None:
    """Once every broker went away, a consumer delivers nothing until the
    group has rejoined (a broker may hold a restarted group's first join for
    seconds); meanwhile the worker claims ready turns from the store. The
    broker stays down here, so no message can deliver the second turn. Back,
    with an empty log, the broker gets the turn's message, which the
    rejoined group skips: each turn runs once."""
    settings = env.settings(claim_ttl_s=3, renew_interval_s=1, agent_turns_partitions=2)
    store, transport = env.open(settings, timeout_s=3.0)
    runs: list[str] = []

    def handler(turn: Any, guard: Any) -> str:
        runs.append(turn.job_id)
        return "ok"

    def succeeded(job_id: str) -> Callable[[], bool]:
        return lambda: store.get(job_id, None).status is Status.SUCCEEDED

    reg = Registry()
    reg.add("work", handler)
    worker = Worker(settings, store, transport, reg, options=WorkerOptions(threads=1, get_wait_s=0.05))
    worker.start()
    try:
        d = Dispatcher(store, transport, settings)
        first = d.submit(Submission(kind="work", tenant="t", session_id="s")).job_id
        assert _until(succeeded(first)), "the group never delivered the first turn"
        env.broker.kill()
        assert _until(lambda: any(oc.outage_at is not None for oc in transport._consumers.values()))
        # Stored while the broker is away (no admission can ask it): the
        # message waits in the outbox.
        job = NewJob(job_id=new_job_id(), tenant="t", session_id="s", kind="work", payload={}, max_attempts=3)
        second = store.submit([job], max_depth=100)[0].item.id
        assert _until(succeeded(second)), "a ready turn waited for the broker"
        assert transport.stats()["direct"] >= 1
        env.broker.start()  # same port, empty log: the relay publishes the second turn's message
        third = d.submit(Submission(kind="work", tenant="t", session_id="s")).job_id
        assert _until(succeeded(third), timeout=60)
        assert _until(lambda: transport.stats()["assignments"] > 1, timeout=60), "the group never rejoined"
    finally:
        worker.stop(grace_s=5)
    assert runs == [first, second, third]


def test_a_prepared_consumer_joins_the_group_before_its_first_get(env: Env) -> None:
    """A worker's preflight starts its consumer's group join, so the broker's
    join delay overlaps start-up; the keepalive serves the assignment."""
    from agentdispatch.runtime import AsyncWorker

    settings = env.settings(agent_turns_partitions=2)
    store, transport = env.open(settings)
    worker = AsyncWorker(settings, store, transport, Registry())
    worker.preflight()
    assert transport.stats()["consumers"] == 1
    deadline = time.monotonic() + 30
    while transport.stats()["assignments"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert transport.stats()["assignments"] >= 1, "the prepared consumer never joined without a get"
    transport.put(_env(1))
    got = _drain(transport, 1, owner=worker.owner)
    assert [Envelope.from_json(d.raw).job_id for d in got] == ["job-1"]


def test_a_consuming_process_re_creates_the_topic_a_restarted_broker_lost(env: Env) -> None:
    """No publish and no admission here: the group watch alone finds the
    topic gone (memory storage) and creates it again, so the consumers find
    it on their next metadata refresh."""
    settings = env.settings(agent_turns_partitions=3)
    _, transport = env.open(settings, stall_s=2.0)
    transport.prepare("w:0")
    env.broker.restart()  # topic, log and group are gone
    deadline = time.monotonic() + 30
    while transport._admin.partitions(timeout_s=2) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert transport._admin.partitions(timeout_s=2) == 3


def test_a_consuming_process_publishes_at_once_on_a_broker_that_lost_its_state(env: Env) -> None:
    """A broker restarted without persistent storage forgot the idempotent
    producer's id, and refuses the old client's messages until they time out
    (Tansu does, epoch bump or not). The group watch that finds the log gone
    starts a new client, so the first publish after the restart goes through
    rather than failing a flush timeout later."""
    settings = env.settings()
    _, transport = env.open(settings, timeout_s=10.0)
    transport.prepare("w:0")
    transport.put(_env(0))  # the client now has a producer id the broker knew
    env.broker.restart()  # topic, log, group and producer ids are gone
    deadline = time.monotonic() + 30
    while transport.producer.resets == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert transport.producer.resets >= 1  # replaced by the watch: no publish has failed
    transport.put(_env(1))  # the old client would have raised after timeout_s
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while "job-1" not in seen and time.monotonic() < deadline:
        d = transport.get("w:0", visibility_s=30, wait_s=0.2)
        if d is not None:
            seen.append(Envelope.from_json(d.raw).job_id)
    assert "job-1" in seen


def test_items_published_after_the_last_probe_of_a_lost_log_go_out_again_at_once(env: Env) -> None:
    """A broker restarted without its log lost every message it had confirmed
    up to the crash. The group watch learns of the loss from a probe; items
    the previous probe of the old log covered went out again at once, but
    those published after it (up to a probe interval before the crash)
    waited for the redelivery delay, or for the group to consume the whole
    new log. The outage the consumers saw bounds the loss: they go out at
    the next reconciler pass too."""
    settings = env.settings(agent_turns_partitions=2)
    # Probes 10 s apart (stall_s / 4), and a redelivery delay far longer than
    # the test: only a detected loss can send an item out again here.
    store, transport = env.open(settings, redeliver_after_s=600.0, stall_s=40.0, timeout_s=3.0)
    d = Dispatcher(store, transport, settings)
    d.submit(Submission(kind="echo", tenant="t", session_id="s-early"))  # the watch follows this relay
    transport.prepare("w:0")
    consumer = transport._consumer("w:0")
    deadline = time.monotonic() + 30
    while transport._probed_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    probed = transport._probed_at
    assert probed is not None, "the group watch never probed the broker"
    subs = [Submission(kind="echo", tenant="t", session_id=f"s{i}") for i in range(5)]
    late = [h.job_id for h in d.submit_many(subs)]
    env.broker.kill()  # memory storage: the log with the late items is gone
    assert transport._probed_at == probed, "a probe came between the publish and the crash: nothing to show"
    while consumer.outage_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert consumer.outage_at is not None, "the consumer never saw the broker go"
    env.broker.start()  # same port, empty log

    def republished(job: str) -> int:
        return sum(e["event"] == "redelivered" for e in store.history(job, "t")["events"])

    deadline = time.monotonic() + 60
    while not all(republished(j) for j in late) and time.monotonic() < deadline:
        with contextlib.suppress(TaskQueueUnavailable):
            reconcile_once(store, transport)
        time.sleep(0.2)
    assert [republished(j) for j in late] == [1] * len(late), "the late items of the lost log were not re-published"
    assert store.get(late[0], "t").status is Status.READY  # re-published, not run: nobody consumes here
    # Their copies are in the new log, but the consumer, back in the group,
    # may be starved (an empty, stale assignment) until the stall watch
    # (stall_s 40 s here) rejoins it; meanwhile its owner gets them from the
    # store.
    seen = {Envelope.from_json(x.raw).job_id for x in _drain(transport, 6, owner="w:0", timeout=60)}
    assert set(late) <= seen


def _pinged(transport: KafkaTransport) -> bool:
    try:
        transport.ping()
    except TaskQueueUnavailable:
        return False
    return True


def test_a_worker_starved_by_a_broker_that_lost_its_log_runs_ready_turns_from_the_store(env: Env) -> None:
    """Back without its log or its group, the broker lets the consumer rejoin
    into nothing: an empty, stale assignment, or no assignment at all for the
    member made anew after the outage; fetches past the new log's end would
    get no out-of-range answer either. Nothing arrived until the stall watch
    rejoined the group. Ready turns whose messages the log lost are run from
    the store meanwhile; the stall watch (``stall_s``) and the redelivery
    delay are far longer than the wait here."""
    settings = env.settings(claim_ttl_s=3, renew_interval_s=1, agent_turns_partitions=2)
    # Group probes 10 s apart (half the redelivery delay; no reconciler runs
    # here), which find the topic gone and create it again; the stall watch
    # far later than the wait here.
    store, transport = env.open(settings, redeliver_after_s=20.0, stall_s=600.0, timeout_s=3.0)
    runs: list[str] = []
    reg = Registry()
    reg.add("work", lambda turn, guard: runs.append(turn.job_id) or "ok")
    opts = WorkerOptions(threads=1, get_wait_s=0.05, reconcile=False)
    worker = Worker(settings, store, transport, reg, options=opts)
    owner = f"{worker.worker_id}:0"
    transport.prepare(owner)  # the worker's consumer, in the group before the crash
    consumer = transport._consumer(owner)
    d = Dispatcher(store, transport, settings)
    subs = [Submission(kind="work", tenant="t", session_id=f"s{i}") for i in range(5)]
    jobs = [h.job_id for h in d.submit_many(subs)]
    env.broker.kill()  # memory storage: the log with their messages is gone
    assert _until(lambda: consumer.outage_at is not None), "the consumer never saw the broker go"
    env.broker.start()  # same port, empty log, no group
    back = time.monotonic()

    def past_the_rejoin() -> bool:
        # Assigned again (Tansu: an empty assignment while the topic is still
        # gone, which its creation by the group watch does not change), or
        # made anew by the keepalive, as a member that saw no rebalance (the
        # new member is never assigned). Before either the consumer is
        # stranded (no assignment since the outage): the store covered that.
        oc = transport._consumer(owner)
        return oc is not consumer or oc._assigned_at > back

    assert _until(past_the_rejoin, timeout=60), "the consumer never rejoined the group"
    worker.start()
    try:

        def succeeded() -> bool:
            return all(store.get(j, None).status is Status.SUCCEEDED for j in jobs)

        assert _until(succeeded, timeout=60), "ready turns waited for the stall watch"
    finally:
        worker.stop(grace_s=5)
    assert sorted(runs) == sorted(jobs)
    assert transport.stats()["direct"] >= len(jobs)
