"""Pure pieces of the Kafka transport: message keys, the grow-only decision,
and the group commit that coalesces flushes (no broker needed)."""

from __future__ import annotations

import threading
import time

import pytest

from agentdispatch.backends.kafka.admin import Plan, cannot_grow, partition_plan
from agentdispatch.backends.kafka.producer import GroupCommit, message_key
from agentdispatch.errors import TaskQueueUnavailable


def test_session_key_outranks_tenant_and_is_opaque():
    key = message_key("chat-42", "acme")
    assert key.startswith(b"session:") and b"chat-42" not in key and b"acme" not in key
    assert key == message_key("chat-42", "other-tenant")  # the session alone decides the partition
    assert key != message_key("chat-43", "acme")
    tenant_key = message_key(None, "acme")
    assert tenant_key.startswith(b"tenant:") and b"acme" not in tenant_key
    assert message_key(None, None) == b"none"


@pytest.mark.parametrize(
    ("current", "wanted", "plan"),
    [(None, 6, Plan.CREATE), (3, 6, Plan.GROW), (6, 6, Plan.OK), (12, 6, Plan.OK)],
)
def test_partitions_are_grow_only(current, wanted, plan):
    assert partition_plan(current, wanted) is plan


def test_cannot_grow_message_names_the_setting_not_the_broker():
    err = cannot_grow("agent_turns", 3, 6, "_UNSUPPORTED_FEATURE")
    assert isinstance(err, TaskQueueUnavailable)
    text = str(err)
    assert "AGENT_TURNS_PARTITIONS=6" in text and "3 partition" in text and "never shrunk" in text
    assert "127.0.0.1" not in text and ":9092" not in text


def test_group_commit_runs_one_round_for_concurrent_callers():
    gate: GroupCommit[int] = GroupCommit(linger_s=0.2)
    calls: list[int] = []
    n = 16
    barrier = threading.Barrier(n)
    results: list[int] = []

    def caller() -> None:
        barrier.wait()
        results.append(gate.run(lambda: calls.append(1) or len(calls)))

    threads = [threading.Thread(target=caller) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gate.rounds == 1 and calls == [1] and results == [1] * n


class _SignallingCondition(threading.Condition):
    """A condition that says when a thread starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_group_commit_late_caller_waits_for_a_fresh_round():
    gate: GroupCommit[float] = GroupCommit()
    cond = gate._cond = _SignallingCondition()
    started = threading.Event()
    release = threading.Event()
    seen: list[float] = []

    def slow() -> float:
        started.set()
        release.wait(5)
        return time.monotonic()

    first = threading.Thread(target=lambda: seen.append(gate.run(slow)))
    first.start()
    started.wait(5)
    joined_at = time.monotonic()
    late = threading.Thread(target=lambda: seen.append(gate.run(time.monotonic)))
    late.start()
    assert cond.waiting.wait(5)  # the late caller joined while the first round ran
    release.set()
    first.join()
    late.join()
    # The late caller's round started after it joined: its precondition is covered.
    assert gate.rounds == 2 and max(seen) > joined_at


def test_group_commit_error_reaches_every_caller_of_the_round():
    gate: GroupCommit[None] = GroupCommit(linger_s=0.1)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def boom() -> None:
        raise TaskQueueUnavailable("delivery failed")

    def caller() -> None:
        barrier.wait()
        try:
            gate.run(boom)
        except TaskQueueUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and gate.rounds == 1


def test_group_commit_waiter_gives_up_at_its_timeout_and_the_round_still_runs():
    gate: GroupCommit[int] = GroupCommit()
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow() -> int:
        calls.append("slow")
        started.set()
        release.wait(30)
        return 1

    leader = threading.Thread(target=gate.run, args=(slow,))
    leader.start()
    assert started.wait(10)
    with pytest.raises(TimeoutError):
        gate.run(lambda: calls.append("mine") or 2, timeout_s=0.2)
    release.set()
    leader.join(10)
    assert gate.run(lambda: calls.append("later") or 3, timeout_s=5) == 3
    assert calls == ["slow", "later"]


def test_stall_watch_rejoins_only_a_stalled_group_it_holds_nothing_of():
    from agentdispatch.backends.kafka.watch import StallWatch

    w = StallWatch(stall_s=10)
    stuck = {0: (5, 9), 1: (3, 3)}
    assert not w.observe(0, stuck, holding=False)  # first look
    assert not w.observe(9, stuck, holding=False)  # not yet stall_s
    assert w.observe(10, stuck, holding=False)  # lag, no commit moved for 10 s
    assert not w.observe(15, stuck, holding=False)  # a whole new period after a rejoin
    assert w.observe(20, stuck, holding=False)
    # Progress, no lag, or partitions held here: never.
    w = StallWatch(stall_s=10)
    assert not w.observe(0, stuck, holding=False)
    assert not w.observe(10, {0: (6, 9), 1: (3, 3)}, holding=False)
    assert not w.observe(19, {0: (6, 9), 1: (3, 3)}, holding=False)
    assert not w.observe(30, {0: (9, 9), 1: (3, 3)}, holding=False)
    assert not w.observe(45, {0: (9, 9), 1: (3, 3)}, holding=False)
    assert not w.observe(60, stuck, holding=True)
    assert not w.observe(75, stuck, holding=True)


def test_stall_watch_counts_a_stall_across_its_rejoins_until_progress():
    from agentdispatch.backends.kafka.watch import StallWatch

    w = StallWatch(stall_s=10)
    stuck = {0: (5, 9)}
    assert not w.observe(0, stuck, holding=False)
    assert w.stalled_for(0) == 0.0
    assert not w.observe(4, stuck, holding=False)
    assert w.stalled_for(4) == 4.0
    assert w.observe(10, stuck, holding=False)  # a rejoin does not end the stall
    assert not w.observe(14, stuck, holding=False)
    assert w.stalled_for(14) == 14.0
    assert not w.observe(16, stuck, holding=True)  # a partition held here: over
    assert w.stalled_for(16) == 0.0
    assert not w.observe(20, stuck, holding=False)
    assert not w.observe(25, {0: (6, 9)}, holding=False)  # a commit moved: over
    assert w.stalled_for(25) == 0.0


def test_backlog_wait_grows_with_lag_over_rate_and_is_zero_when_unknown():
    from agentdispatch.backends.kafka.watch import Backlog

    b = Backlog()
    assert b.wait_s(0) == 0.0
    b.observe(0, {0: (0, 1000), 1: (0, 1000)})
    assert b.wait_s(0) == 0.0  # no rate yet: no extra wait
    b.observe(10, {0: (500, 1000), 1: (500, 1000)})  # 100 msgs/s, 1,000 left
    assert b.wait_s(10) == pytest.approx(20.0)
    assert b.wait_s(100) == 0.0  # stale
    assert not b.stalled(10)
    b.observe(20, {0: (500, 1000), 1: (500, 1000)})  # not consumed for 10 s: stalled, not slow
    assert b.stalled(20) and b.wait_s(20) == 0.0
    b.observe(30, {0: (1000, 1000), 1: (1000, 1000)})
    assert b.wait_s(30) == 0.0 and not b.stalled(30)  # drained


def test_backlog_an_idle_spell_neither_slows_the_rate_nor_reads_as_a_stall():
    from agentdispatch.backends.kafka.watch import Backlog

    b = Backlog(still_s=3.0)
    b.observe(0, {0: (0, 1000)})
    b.observe(10, {0: (1000, 1000)})  # 100 msgs/s, then nothing to do for long
    for t in range(11, 200):
        b.observe(t, {0: (1000, 1000)})
    b.observe(200, {0: (1000, 1400)})  # a new wave: its pace is still the last one seen
    assert not b.stalled(200)
    assert b.wait_s(200) == pytest.approx(8.0)
    b.observe(201, {0: (1100, 1400)})
    b.observe(204, {0: (1100, 1400)})  # then the group stops consuming
    assert b.stalled(204) and b.wait_s(204) == 0.0


def test_backlog_keeps_its_rate_when_a_restarted_broker_resets_the_offsets():
    from agentdispatch.backends.kafka.watch import Backlog

    b = Backlog()
    b.observe(0, {0: (0, 2000)})
    b.observe(10, {0: (1000, 2000)})  # 100 msgs/s
    b.observe(11, {0: (0, 500)})  # a new log: offsets start again
    assert b.wait_s(11) == pytest.approx(10.0)  # 500 left at the rate seen before


def test_drained_cutoff_is_the_newest_probe_whose_watermarks_the_group_reached():
    from agentdispatch.backends.kafka.watch import Drained

    d = Drained()
    d.observe(0, {0: (0, 10), 1: (0, 5)})
    assert d.cutoff() is None  # behind the only probe
    d.observe(1, {0: (10, 20), 1: (3, 5)})
    assert d.cutoff() is None  # partition 1 has not reached 5 yet
    d.observe(2, {0: (15, 20), 1: (5, 8)})
    assert d.cutoff() == 0  # everything published before t=0 is consumed
    d.observe(3, {0: (20, 20), 1: (8, 8)})
    assert d.cutoff() == 3  # caught up with the latest probe
    # A restarted broker: a new log, offsets from 0. What was published
    # before is gone, so the group reaching the new log's watermarks counts.
    d.observe(4, {0: (0, 2), 1: (0, 0)})
    assert d.cutoff() == 3
    d.observe(5, {0: (2, 2), 1: (0, 0)})
    assert d.cutoff() == 5
    # Never moves back.
    d.observe(6, {0: (2, 50), 1: (0, 0)})
    assert d.cutoff() == 5
    # A group that never reaches the new log's end (a long turn holds a
    # partition's commit): a second restart still moves the cutoff to the last
    # probe of the log it lost.
    d.observe(7, {0: (3, 80), 1: (0, 9)})
    assert d.cutoff() == 5
    d.observe(9, {0: (0, 4), 1: (0, 0)})
    assert d.cutoff() == 7


def test_drained_tells_which_probe_first_saw_a_new_log():
    from agentdispatch.backends.kafka.watch import Drained, with_ends

    d = Drained()
    assert not d.observe(0, {0: (0, 10), 1: (0, 5)})
    assert not d.observe(1, {0: (10, 20), 1: (5, 5)})
    # The broker lost its log: offsets went back. That probe says so, once.
    assert d.observe(2, {0: (0, 0), 1: (0, 0)})
    assert d.lost_at == 1
    assert not d.observe(3, {0: (0, 4), 1: (0, 0)})
    # A consumer's fetch of the old log raises the ends; the broker's own
    # answer still shows the next loss.
    assert not d.observe(4, with_ends({0: (4, 4), 1: (0, 2)}, {0: 4}), {0: (4, 4), 1: (0, 2)})
    assert d.observe(5, with_ends({0: (0, 0), 1: (0, 0)}, {0: 4}), {0: (0, 0), 1: (0, 0)})
    assert d.lost_at == 4


def test_a_producer_renewed_for_a_lost_broker_state_starts_over_once():
    from agentdispatch.backends.kafka.producer import CoalescingProducer

    # No broker needed: a client is made without connecting.
    p = CoalescingProducer({"bootstrap.servers": "127.0.0.1:1"}, "t", flush_timeout_s=0.5)
    try:
        first = p._p
        before = time.monotonic()
        p.renew()  # the topic is gone: start over
        second = p._p
        assert second is not first and p.resets == 1
        # The same loss seen again (a probe of the new log): a client made
        # after the last probe of the old log is kept.
        p.renew(older_than=before)
        assert p._p is second and p.resets == 1
        p.renew(older_than=time.monotonic())  # a later loss: made before it
        assert p._p is not second and p.resets == 2
    finally:
        p.close()


def test_kafka_redelivery_waits_for_the_group_to_pass_the_items_publish_with_bounds():
    from agentdispatch.backends.kafka.transport import PUBLISH_MARGIN_S, KafkaTransport
    from agentdispatch.backends.kafka.watch import Backlog, Drained

    t = KafkaTransport.__new__(KafkaTransport)  # no broker: only the redelivery arithmetic
    t._redeliver_base_s = 3.0
    t.stall_s = 12.0
    t._backlog = Backlog()
    t._drained = Drained()
    now = time.monotonic()
    # A process that has not probed the group yet judges nothing (a fresh
    # worker re-published a whole backlog the group had all along).
    assert t.redeliver_after_s == 2 * 3.0 + 12.0
    t._backlog.observe(now - 20, {0: (0, 1000)})
    t._backlog.observe(now - 10, {0: (500, 1000)})  # 50 msgs/s, 500 left: 20 s to consume
    t._drained.observe(now - 20, {0: (0, 400)})
    t._drained.observe(now - 10, {0: (500, 1000)})
    # The group passed the probe of 20 s ago: items published before it
    # (less the publish margin) are stranded, later ones are still in the log.
    assert t.redeliver_after_s == pytest.approx(20 + PUBLISH_MARGIN_S, abs=0.5)
    # A group that consumes nothing (rejoining, or a wedged assignment): two
    # TTLs and the stall watch's period, so its items keep going out.
    fresh = Drained()
    fresh.observe(now - 5, {0: (0, 400)})
    t._drained, drained = fresh, t._drained
    t._backlog, backlog = Backlog(), t._backlog
    t._backlog.observe(now - 5, {0: (0, 400)})
    assert t.redeliver_after_s == pytest.approx(2 * 3.0 + 12.0)
    t._drained, t._backlog = drained, backlog
    # At most twice a TTL plus twice the backlog time (a group stuck on one
    # partition must not keep a lost message from coming back for long).
    t._drained = Drained()
    t._drained.observe(now - 500, {0: (0, 0)})
    assert t.redeliver_after_s == pytest.approx(2 * 3.0 + 2 * 500 / 50, abs=0.5)
    # Caught up just now: at least a TTL.
    t._drained.observe(now, {0: (1000, 1000)})
    assert t.redeliver_after_s == pytest.approx(3.0, abs=0.1)
    # The broker lost that log just now (offsets went back): what the last
    # probe of it covered goes out again at once, not a TTL after its publish.
    t._drained.observe(now + 0.2, {0: (0, 0)})
    assert t._drained.lost_at == now
    assert t.redeliver_after_s == pytest.approx(PUBLISH_MARGIN_S, abs=0.1)
    # Items published since wait as before (the group reached the new log's
    # first probe, so no more than a TTL).
    t._drained.observe(now + 0.4, {0: (0, 7)})
    lost_for = time.monotonic() - now
    assert t.redeliver_after_s == pytest.approx(min(3.0, lost_for + PUBLISH_MARGIN_S), abs=0.1)


def test_log_ends_from_fetches_raise_a_broker_answer_that_left_records_out():
    from agentdispatch.backends.kafka.watch import Drained, with_ends

    # Tansu's ListOffsets gives 1 for a partition holding one batch of 80.
    said = {0: (0, 1), 1: (40, 1), 2: (5, 9)}
    seen = with_ends(said, {0: 80})
    assert seen[0] == (0, 80)  # a consumer's fetch saw the real end
    assert seen[1] == (40, 41)  # read past the answer: the end is unknown, never "caught up"
    assert seen[2] == (5, 9)
    # A consumer's end of the old log (a restart it has not fetched since)
    # keeps the group from reading as caught up, but is no loss, and the
    # broker's own answer still shows the loss.
    d = Drained()
    d.observe(0, with_ends({0: (80, 80)}, {0: 80}), {0: (80, 80)})
    assert d.cutoff() == 0
    d.observe(1, with_ends({0: (0, 0)}, {0: 80}), {0: (0, 0)})
    assert d.cutoff() == 0  # the loss: what the probe at 0 covered is gone
    d.observe(2, with_ends({0: (0, 3)}, {0: 80}), {0: (0, 3)})
    assert d.cutoff() == 0
    d.observe(3, with_ends({0: (3, 3)}, {0: 3}), {0: (3, 3)})
    assert d.cutoff() == 3


def test_a_consumer_close_that_hangs_in_the_client_does_not_hang_its_caller(caplog: pytest.LogCaptureFixture) -> None:
    # librdkafka's close can wait for good inside a rebalance callback; the
    # caller (a stopping worker, a test's teardown) must get its thread back.
    from agentdispatch.backends.kafka.consumer import OwnedConsumer

    config = {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}
    oc = OwnedConsumer("owner", config, "topic", buffer_max=4)
    real, release, entered = oc._c, threading.Event(), threading.Event()

    class Stuck:
        def close(self) -> None:
            entered.set()
            release.wait()
            real.close()

    oc._c = Stuck()  # type: ignore[assignment]
    try:
        with caplog.at_level("WARNING", logger="agentdispatch.kafka"):
            oc.close(timeout_s=0.2)
        assert entered.is_set() and oc.closed
        assert "did not leave its group" in caplog.text
        assert oc.get(visibility_s=1.0, wait_s=0.0) is None  # closed: hands out nothing
    finally:
        release.set()


def test_a_fresh_assignment_is_warm_once_each_partition_reached_its_fetched_end() -> None:
    # While turns keep arriving a fetch rarely ends at EOF: the log end the
    # last fetch answered with counts as reached, so a rejoin after a broker
    # restart does not wait the whole warm-up.
    from agentdispatch.backends.kafka.consumer import WARMUP_S, OwnedConsumer

    config = {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}
    oc = OwnedConsumer("owner", config, "topic", buffer_max=4)
    real, ends = oc._c, {0: 5, 1: 3}

    class Fetched:
        def get_watermark_offsets(self, tp: object, cached: bool = False) -> tuple[int, int]:
            return 0, ends[tp.partition]  # type: ignore[attr-defined]

    oc._c = Fetched()  # type: ignore[assignment]
    try:
        now = time.monotonic()
        oc.assigned, oc._assigned_at = {0, 1}, now
        assert not oc._warm(now)  # nothing fetched since the assignment
        oc._fetched_at = {0: now, 1: now}
        oc._next = {0: 5, 1: 2}
        assert not oc._warm(now)  # partition 1 is one message short of its end
        oc._eof.add(1)
        assert oc._warm(now)
        oc._eof.clear()
        oc._next[1] = 3
        assert oc._warm(now)
        oc._fetched_at = {0: now - 1, 1: now}  # an end fetched before the assignment says nothing
        assert not oc._warm(now)
        assert oc._warm(now + WARMUP_S)  # the warm-up is still bounded
    finally:
        oc._c = real
        oc.close()
