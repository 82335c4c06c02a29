"""One Kafka consumer per owner (worker thread), with a small local buffer.

Offsets: a partition's committed offset is the lowest offset this consumer has
fetched but not acknowledged (buffered, held or in flight), so nothing is ever
committed past a turn whose fenced commit has not happened. Acks may arrive out
of order (priority picks, released deliveries); the commit point only moves
forward over a contiguous acknowledged prefix.

``release`` keeps the message in the buffer, uncommitted, until ``delay_s``
passes: no re-publish, nothing a crash could lose (an uncommitted message is
fetched again by whoever owns the partition next).

Session order: the buffered messages of one session (tenant and session id)
are ordered by the item's ``seq`` header, not by offset, because a retry is
re-published behind the turns that follow it. Only a session's first message
in that order may be handed out; while it is held back (released busy) the
whole session waits, as the store would refuse its later turns anyway. Such
waiting messages do not count against ``buffer_max`` (only a session's head
that may run now does), so fetching goes on until the message a session waits
for arrives; ``HARD_FACTOR * buffer_max`` bounds the memory.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from ...errors import TaskQueueUnavailable
from ...transports.base import Delivery, Receipt

log = logging.getLogger("agentdispatch.kafka")

_SEQ = itertools.count()

#: The longest a fresh assignment waits for every partition's backlog.
WARMUP_S = 1.0

#: The header carrying the item's session order (its ``seq`` in the store).
SEQ_HEADER = "agentdispatch-seq"

#: Messages that cannot run now may fill the buffer up to this many times
#: ``buffer_max`` before fetching pauses regardless.
HARD_FACTOR = 16

#: How long an assignment after an outage may go without a fetch answer on a
#: partition before the consumer counts as starved (see :meth:`OwnedConsumer.stranded`).
STARVE_S = 2.0

#: The longest :meth:`OwnedConsumer.close` waits for the client to leave its group.
CLOSE_TIMEOUT_S = 10.0

Group = tuple[int, str, str]


@dataclass
class _Entry:
    """A fetched message this consumer has not acknowledged."""

    partition: int
    offset: int
    group: Group  # (partition, tenant, session): the unit of session order
    order: tuple[int, int]  # (seq, offset); seq -1 when the header is missing
    raw: str
    priority: int
    deadline: float | None
    seq: int
    visible_at: float = 0.0  # monotonic; released entries wait until then
    deliveries: int = 0
    taken_at: float = 0.0  # monotonic; when handed out (in flight)
    visibility_s: float = 0.0


def _seq(msg: Message) -> int:
    headers = msg.headers() or []
    pairs = headers.items() if isinstance(headers, dict) else headers
    for name, value in pairs:
        if name == SEQ_HEADER and value:
            with contextlib.suppress(ValueError):
                return int(value)
    return -1  # published without one (an older relay): before any that has one


def _entry(msg: Message) -> _Entry:
    raw = (msg.value() or b"").decode("utf-8", "replace")
    partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
    priority, deadline = 0, None
    group: Group = (partition, "", f"#{offset}")  # unparseable: a group of its own (poison)
    try:  # ordering hints only; validation (poison) is the worker's job
        body = json.loads(raw)
        priority = int(body.get("priority") or 0)
        d = body.get("deadline_unix")
        deadline = float(d) if d is not None else None
        tenant, session = body["tenant"], body["session_id"]
        if isinstance(tenant, str) and isinstance(session, str):
            group = (partition, tenant, session)
    except (ValueError, TypeError, AttributeError, KeyError):
        pass
    return _Entry(
        partition=partition,
        offset=offset,
        group=group,
        order=(_seq(msg), offset),
        raw=raw,
        priority=priority,
        deadline=deadline,
        seq=next(_SEQ),
    )


class OwnedConsumer:
    """The consumer of one owner. Every method takes ``self.lock``."""

    def __init__(
        self, owner: str, config: dict[str, Any], topic: str, *, buffer_max: int, poll_every_s: float = 1.0
    ) -> None:
        self.owner = owner
        self.topic = topic
        self.buffer_max = buffer_max
        self.poll_every_s = poll_every_s
        self.pauses = 0
        self.incarnation = next(_SEQ)
        self.lock = threading.RLock()
        self.closed = False
        self.last_poll = time.monotonic()
        self.assigned: set[int] = set()
        self.revocations = 0
        self.assignments = 0
        self.hard_max = buffer_max * HARD_FACTOR
        # Each session's buffered messages in session order: only the first may run.
        self._groups: dict[Group, list[_Entry]] = {}
        self._buffered = 0
        self._inflight: dict[tuple[int, int], _Entry] = {}
        self._outstanding: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        self._paused = False
        self._eof: set[int] = set()
        # Per partition: when a fetch last answered (a message or its end).
        self._fetched_at: dict[int, float] = {}
        self._assigned_at = 0.0
        # Group liveness: when every broker went away, a consumer must see a
        # rebalance (a fresh assignment, possibly empty) once they are back.
        self.outage_at: float | None = None
        # When the latest outage began (its first report; the client repeats
        # it while the brokers stay away): every message confirmed before
        # then is in the log the brokers had, which a restart may have lost.
        self.outage_began: float | None = None
        self.rebalanced_at = time.monotonic()
        # Until the owner first gets, the keepalive polls for it (a prepared
        # consumer's assignment and first fetches must not wait for that).
        self.used = False
        self._error_sink = config.get("error_cb")
        self._c = Consumer({**config, "enable.partition.eof": True, "error_cb": self._on_error})
        self._c.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke)

    # -- rebalance callbacks (run inside poll, under self.lock) ---------------
    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            now = time.monotonic()
            last = self.outage_at
            if last is None or self.rebalanced_at >= last or any(t > last for t in self._fetched_at.values()):
                self.outage_began = now  # a new outage, not the same one reported again
            self.outage_at = now
        if self._error_sink is not None:
            self._error_sink(err)

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self.assignments += 1
        self.rebalanced_at = time.monotonic()
        self.assigned = {p.partition for p in parts}
        self._paused = False
        self._eof = set()
        self._assigned_at = time.monotonic()

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self.revocations += 1
        self.rebalanced_at = time.monotonic()
        gone = {p.partition for p in parts}
        self.assigned -= gone
        # Uncommitted messages of revoked partitions are re-fetched by the next
        # owner; deliveries in flight become stale (their ack is refused).
        self._drop(gone)
        for p in gone:
            self._outstanding.pop(p, None)
            self._next.pop(p, None)
            self._committed.pop(p, None)

    # -- fetching --------------------------------------------------------------
    def _poll(self, timeout: float) -> bool:
        """One poll; buffers what arrives (also called by the keepalive).
        False when it did not poll: the buffer is full and the group needs
        no sign of life yet (the messages wait in the client's own queue)."""
        room = min(self.buffer_max - self._runnable(time.monotonic()), self.hard_max - self._buffered)
        if not self._throttle(room):
            return False
        msg = self._c.poll(timeout)
        self.last_poll = time.monotonic()
        fetched = 0
        while msg is not None:
            err = msg.error()
            if err is None:
                self._fetched_at[int(msg.partition() or 0)] = self.last_poll
                self._add(_entry(msg))
            elif err.fatal():
                raise TaskQueueUnavailable(f"fatal Kafka consumer error ({err.name()})")
            elif err.code() == KafkaError._PARTITION_EOF:
                self._eof.add(int(msg.partition() or 0))
                self._fetched_at[int(msg.partition() or 0)] = self.last_poll
            # else transient (broker restart, rebalance): librdkafka recovers
            fetched += 1
            if fetched >= room:
                break
            msg = self._c.poll(0)  # drain what is already fetched, without waiting
        return True

    def _add(self, e: _Entry) -> None:
        if e.partition not in self.assigned:
            return
        pending = self._outstanding.setdefault(e.partition, set())
        if e.offset in pending:
            return  # fetched twice (a seek after an error): one copy is enough
        if e.offset < self._committed.get(e.partition, -1):
            self._rewound(e.partition)  # the broker lost its log: start the partition over
        self._outstanding.setdefault(e.partition, set()).add(e.offset)
        self._next[e.partition] = max(self._next.get(e.partition, 0), e.offset + 1)
        self._push(e)

    def _push(self, e: _Entry) -> None:
        bisect.insort(self._groups.setdefault(e.group, []), e, key=lambda x: x.order)
        self._buffered += 1

    def _drop(self, parts: set[int]) -> None:
        """Forget the buffered and in-flight messages of ``parts``."""
        for g in [g for g in self._groups if g[0] in parts]:
            self._buffered -= len(self._groups.pop(g))
        self._inflight = {k: e for k, e in self._inflight.items() if e.partition not in parts}

    def _rewound(self, part: int) -> None:
        # Offsets of the old log mean nothing now; in-flight deliveries of the
        # partition become stale (their turns still commit in the store).
        self._drop({part})
        for d in (self._outstanding, self._next, self._committed):
            d.pop(part, None)

    def _runnable(self, now: float) -> int:
        """Sessions whose first message may run now (what ``buffer_max`` bounds)."""
        return sum(1 for q in self._groups.values() if q[0].visible_at <= now)

    def _throttle(self, room: int) -> bool:
        """Whether to poll now, pausing or resuming the partitions first.

        A full buffer stops taking messages from the client, whose queue keeps
        them (bounded by ``queued.max.messages.kbytes``). Pausing instead made
        the client drop everything it had fetched and fetch it again on
        resume, once per buffer's worth: most of a drain's time. It pauses
        only when the buffer stays full for ``poll_every_s``: then a poll must
        keep the consumer a live group member, and must not bring messages."""
        parts = [TopicPartition(self.topic, p) for p in sorted(self.assigned)]
        if room > 0:
            if self._paused and parts:
                self._c.resume(parts)
            self._paused = False
            return True
        if time.monotonic() - self.last_poll < self.poll_every_s:
            return False
        if not self._paused and parts:
            self._c.pause(parts)
            self._paused = True
            self.pauses += 1
        return True

    def _warm(self, now: float) -> bool:
        # Right after an assignment partitions start fetching one by one; wait
        # (briefly) until each reached its end once, so the first pick sees the
        # backlog of every partition and honours deadlines and priorities.
        if now - self._assigned_at >= WARMUP_S or all(self._caught_up(p) for p in self.assigned):
            return True
        return self._buffered >= self.hard_max or self._runnable(now) >= self.buffer_max

    def _caught_up(self, part: int) -> bool:
        """Whether ``part`` reached its end once since the assignment: its end
        (EOF), or the log end its last fetch answered with. While turns keep
        arriving a fetch rarely ends at EOF, and every fresh assignment (each
        rejoin after a broker restart) waited the whole warm-up."""
        if part in self._eof:
            return True
        if self._fetched_at.get(part, float("-inf")) < self._assigned_at:
            return False
        try:
            _low, high = self._c.get_watermark_offsets(TopicPartition(self.topic, part), cached=True)
        except Exception:  # no fetch answer cached yet
            return False
        return high is not None and 0 <= high <= self._next.get(part, 0)

    def _pick(self, now_mono: float, now_unix: float) -> _Entry | None:
        """Expired deadlines first, then priority, then arrival; only the first
        message of each session (in session order) is eligible, and none of a
        session with a message in flight here."""
        busy = {e.group for e in self._inflight.values()}
        best: _Entry | None = None
        best_key: tuple[bool, int, int] | None = None
        for g, q in self._groups.items():
            e = q[0]
            if e.visible_at > now_mono or g in busy:
                continue
            k = (not (e.deadline is not None and e.deadline <= now_unix), -e.priority, e.seq)
            if best_key is None or k < best_key:
                best, best_key = e, k
        return best

    def _take(self, e: _Entry) -> None:
        q = self._groups[e.group]
        q.remove(e)
        if not q:
            del self._groups[e.group]
        self._buffered -= 1

    def get(self, visibility_s: float, wait_s: float) -> Delivery | None:
        """Hand out one message, polling up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        self.used = True
        polled = False
        while True:
            with self.lock:
                if self.closed:
                    return None
                now = time.monotonic()
                e = self._pick(now, time.time()) if self._warm(now) else None
                if e is not None:
                    self._take(e)
                    e.deliveries += 1
                    e.taken_at, e.visibility_s = now, visibility_s
                    self._inflight[(e.partition, e.offset)] = e
                    ref = (self.incarnation, e.partition, e.offset)
                    return Delivery(raw=e.raw, receipt=Receipt(self.owner, now, ref), deliveries=e.deliveries)
                remaining = deadline - now
                if remaining <= 0 and polled:
                    return None
                polled = True
                if self._poll(min(max(remaining, 0.0), 0.1)):  # at least one try, even with wait_s=0
                    continue
            # A full buffer of turns that cannot run now: wait for an ack or a
            # release (outside the lock, which they take) or a due poll.
            time.sleep(min(max(remaining, 0.0), 0.01))

    # -- acknowledgement -------------------------------------------------------
    def _owned(self, receipt: Receipt) -> _Entry | None:
        ref = receipt.ref
        if self.closed or receipt.owner != self.owner or not isinstance(ref, tuple) or len(ref) != 3:
            return None
        inc, part, off = ref
        e = self._inflight.get((part, off))
        if inc != self.incarnation or e is None or e.taken_at != receipt.claimed_at:
            return None
        return e

    def ack(self, receipt: Receipt) -> bool:
        """Commit past the message if this receipt still owns it."""
        return self.ack_many([receipt])[0]

    def ack_many(self, receipts: list[Receipt]) -> list[bool]:
        """:meth:`ack` for each receipt, behind one offset commit for all
        their partitions (a commit per message was a broker request each)."""
        with self.lock:
            out: list[bool] = []
            touched: set[int] = set()
            for receipt in receipts:
                e = self._owned(receipt)
                out.append(e is not None)
                if e is None:
                    continue
                del self._inflight[(e.partition, e.offset)]
                self._outstanding.get(e.partition, set()).discard(e.offset)
                touched.add(e.partition)
            self._commit(touched)
            return out

    def _commit(self, parts: set[int]) -> None:
        """Move each partition's commit point to its lowest unacknowledged offset."""
        moved: dict[int, int] = {}
        for p in sorted(parts):
            pending = self._outstanding.get(p)
            target = min(pending) if pending else self._next.get(p, 0)
            if target > self._committed.get(p, -1):
                moved[p] = target
        if not moved:
            return
        self._committed.update(moved)
        try:
            offsets = [TopicPartition(self.topic, p, off) for p, off in moved.items()]
            self._c.commit(offsets=offsets, asynchronous=True)
        except Exception:
            # Not committed: the messages are redelivered and skipped (terminal).
            for p in moved:
                self._committed.pop(p, None)

    def release(self, receipt: Receipt, delay_s: float) -> bool:
        """Put the message back in the buffer, uncommitted, for ``delay_s``."""
        with self.lock:
            e = self._owned(receipt)
            if e is None:
                return False
            del self._inflight[(e.partition, e.offset)]
            e.visible_at = time.monotonic() + max(0.0, delay_s)
            self._push(e)
            return True

    # -- keepalive -------------------------------------------------------------
    def keepalive(self, now: float, interval_s: float, on_expired: Callable[[OwnedConsumer], None]) -> None:
        """Called by the transport's keepalive thread: while the owner runs a
        turn (or has not got yet) it does not poll, so poll for it (staying in
        the group past ``max.poll.interval.ms``); a delivery past its
        visibility hands the partitions off to the other consumers."""
        if not self.lock.acquire(blocking=False):
            return  # the owner is polling right now
        try:
            if self.closed or (self.used and not self._inflight):
                return
            if any(now - e.taken_at > e.visibility_s for e in self._inflight.values()):
                on_expired(self)
                return
            if now - self.last_poll >= interval_s:
                self._poll(0)
        finally:
            self.lock.release()

    def lost_group(self, now: float, rejoin_s: float) -> bool:
        """True when every broker went away ``rejoin_s`` ago or more and no
        rebalance has reached this consumer since: a broker that lost its
        group state (or a coordinator that forgot this member) leaves it
        polling outside the group for good; only a new member rejoins.
        Consumers with a delivery in flight wait for its ack."""
        outage = self.outage_at
        if outage is None or self.rebalanced_at >= outage or now - outage < rejoin_s:
            return False
        if not self.lock.acquire(blocking=False):
            return False
        try:
            return not self.closed and not self._inflight
        finally:
            self.lock.release()

    def stranded(self, now: float | None = None, starve_s: float = STARVE_S, bridge_s: float = 0.0) -> bool:
        """Whether the group cannot deliver to this consumer now: every
        broker went away and since then the consumer has had neither an
        assignment nor a fetch answer. It delivers again once the group has
        rejoined; until then its owner may claim ready items from the store
        (:mod:`.direct`).

        Also while it is starved: assigned since the outage, ``starve_s`` ago
        or more (less than ``starve_s + bridge_s``), and a partition it holds
        has had no fetch answer since the outage, or it holds none. A broker
        that lost its log and its group may hand out an empty (stale)
        assignment, or leave fetch positions past its new log's end without
        an out-of-range answer: nothing arrives until the stall watch rejoins
        the group (``stall_s``, the bridge). A broker that keeps its log
        answers a fetch at once (a message, or the partition's end)."""
        edge = self.outage_at
        if edge is None:
            return False
        if self._assigned_at <= edge:
            return not any(t > edge for t in self._fetched_at.values())
        held = (time.monotonic() if now is None else now) - self._assigned_at
        if held < starve_s or held >= starve_s + bridge_s:
            return False
        return not self.assigned or any(self._fetched_at.get(p, edge) <= edge for p in self.assigned)

    def log_ends(self, wait_s: float = 0.5) -> dict[int, int]:
        """Each assigned partition's log end as this consumer's fetches saw it
        (some brokers answer a ListOffsets with less: Tansu leaves out the
        last record batch). Empty when the consumer is closed, or its owner
        holds it past ``wait_s``: the client must never be used while another
        thread's close destroys it, and a probe must not wait long."""
        if not self.lock.acquire(timeout=wait_s):
            return {}
        try:
            if self.closed:
                return {}
            # Only partitions fetched since the brokers were last all gone: a
            # restarted broker without persistent storage has a new log, and
            # an end seen in the old one would read as a backlog never consumed.
            outage = self.outage_at if self.outage_at is not None else float("-inf")
            fresh = [p for p in self.assigned if self._fetched_at.get(p, outage) > outage]
            out: dict[int, int] = {}
            for p in fresh:
                try:
                    _low, high = self._c.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
                except Exception:  # nothing fetched yet
                    continue
                if high is not None and high >= 0:
                    out[p] = int(high)
            return out
        finally:
            self.lock.release()

    def stats(self) -> dict[str, int]:
        """Counters for tests and metrics."""
        with self.lock:
            return {
                "buffered": self._buffered,
                "inflight": len(self._inflight),
                "assignments": self.assignments,
                "revocations": self.revocations,
                "pauses": self.pauses,
            }

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Leave the group (uncommitted messages go to the next owner), waiting
        at most ``timeout_s``: the client's close can hang for good inside a
        rebalance, and a stopping worker must not hang with it (the broker
        evicts a member that left silently after its session timeout)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._groups.clear()
            self._buffered = 0
            self._inflight.clear()
        closer = threading.Thread(target=self._leave, name="kafka-consumer-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            log.warning("the Kafka consumer did not leave its group within %g s; the broker evicts it later", timeout_s)

    def _leave(self) -> None:
        # Already closed or broker gone: leaving is best effort. Not under
        # self.lock: the rebalance callbacks it runs touch only a closed consumer.
        with contextlib.suppress(Exception):
            self._c.close()
