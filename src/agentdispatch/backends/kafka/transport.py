"""The Kafka transport: envelopes on topic ``agent_turns``, group ``agent-dispatch``.

WorkItems stay in the store; the store's ``agent_dispatch_queue`` table is the
outbox. ``relay`` publishes it behind one delivery-confirmed flush and deletes
the rows only after the broker confirmed them, so a crash between the store
commit and the publish is healed by the next relay, and a message Kafka loses
is healed by the reconciler re-enqueueing the ready item (``redeliver_after_s``).

Each owner (worker thread) gets its own consumer; offsets are committed only on
``ack``, which the worker calls after the fenced commit. While an owner runs a
turn, a keepalive thread polls its consumer so that a turn longer than
``max.poll.interval.ms`` neither duplicates nor triggers a rebalance; a
delivery that outlives its visibility hands its partitions to the other
consumers (the SQS-like contract every transport shares). While the group
cannot deliver to a consumer after an outage (no assignment yet, or one that
fetches nothing), its owner claims ready items from the store (:mod:`.direct`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...envelope import Envelope
from ...errors import AgentDispatchError, QueueFull, TaskQueueUnavailable
from ...quietlogs import demote
from ...settings import KAFKA_GROUP, KAFKA_TOPIC, Settings
from ...transports.base import Delivery, get_each
from .admin import TopicAdmin, TopicMissing
from .consumer import SEQ_HEADER, OwnedConsumer
from .direct import DirectClaims, StoreRef
from .producer import CoalescingProducer, GroupCommit, message_key
from .watch import Backlog, Drained, StallWatch, with_ends

if TYPE_CHECKING:
    from ...stores.base import Outbox

log = logging.getLogger("agentdispatch.kafka")

#: Outbox rows taken per relay step.
RELAY_BATCH = 500

#: How long other processes' relays leave the outbox rows a relay took to it.
RELAY_HOLD_S = 1.0

#: The longest a busy Kafka delivery is held while turns are claimed from the store.
DIRECT_BUSY_S = 0.25

#: Slack between the store's clock, which stamps an item when it is queued,
#: and this process's, which times the relay that published it.
PUBLISH_MARGIN_S = 1.0


def _client_log_sink(err: Any) -> None:
    # librdkafka's own messages name brokers; keep them out of user-facing output.
    log.debug("kafka client error: %s", getattr(err, "name", lambda: err)())


class KafkaTransport:
    """Envelopes on Kafka; the store stays the WorkItem authority."""

    name = "kafka"

    #: Monotonic: when the outage in which the broker lost its log began, if
    #: a consumer of this process saw it (see :meth:`_mark_lost`).
    _outage_edge: float | None = None

    def __init__(
        self,
        settings: Settings,
        *,
        topic: str = KAFKA_TOPIC,
        group: str = KAFKA_GROUP,
        redeliver_after_s: float | None = None,
        max_poll_interval_ms: int = 60_000,
        # The lowest a default Apache Kafka broker accepts (group.min.session.timeout.ms):
        # a dead member's partitions move on sooner, and a broker that holds a
        # new member's JoinGroup for part of it lets the first turn start sooner.
        session_timeout_ms: int = 6_000,
        timeout_s: float = 10.0,
        linger_s: float = 0.0,
        coalesce: bool = True,
        buffer_max: int = 256,
        keepalive_s: float = 1.0,
        stall_s: float | None = None,
        client_config: dict[str, Any] | None = None,
    ) -> None:
        if not settings.kafka_bootstrap_servers:
            raise TaskQueueUnavailable("KAFKA_BOOTSTRAP_SERVERS is required with TASK_QUEUE_BACKEND=kafka")
        self.topic = topic
        self.group = group
        self.wanted_partitions = settings.agent_turns_partitions
        # About one claim TTL: a ready item not run by then lost its message.
        self._redeliver_base_s = settings.claim_ttl_s if redeliver_after_s is None else redeliver_after_s
        self._backlog = Backlog(still_s=self._redeliver_base_s)
        self._drained = Drained()
        # When the last relay round that emptied the outbox took its rows (it
        # returned after the broker confirmed them): every item queued before
        # then has its message in the log, or in a log the broker lost.
        self._relayed_through: float | None = None
        # Outbox rows this process's relay takes are held from the others' for
        # a while: every process relays, and each published every row it saw
        # until one of them had the broker's confirmation (after a restart,
        # when confirmations take a second, each message went out once per
        # process). Briefly: a relay whose client is stuck (a producer of a
        # log the broker lost, in a process that has not noticed yet) must
        # not hold the rows for long; the others then publish them too.
        self._relayer_id = f"kafka-relay-{uuid.uuid4().hex[:16]}"
        self.relay_hold_s = min(timeout_s, RELAY_HOLD_S)
        self.keepalive_s = keepalive_s
        self.timeout_s = timeout_s
        self.buffer_max = buffer_max
        base: dict[str, Any] = {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "client.id": "agentdispatch",
            "logger": demote(logging.getLogger("agentdispatch.kafka.client")),
            "error_cb": _client_log_sink,
            "topic.metadata.refresh.interval.ms": 5000,
            # The client's reconnect backoff doubles up to 10 s by default: a
            # broker back after a few seconds was reached seconds late.
            "reconnect.backoff.max.ms": 1000,
            # Only start-up creates the topic, with AGENT_TURNS_PARTITIONS.
            "allow.auto.create.topics": False,
            **(client_config or {}),
        }
        self._consumer_config = {
            **base,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "max.poll.interval.ms": max_poll_interval_ms,
            "session.timeout.ms": session_timeout_ms,
            # A member learns of a rebalance, or that a restarted broker forgot
            # it, from a heartbeat's answer: one a second (librdkafka's 3 s
            # default added up to 3 s per rebalance round after a restart).
            "heartbeat.interval.ms": min(1000, session_timeout_ms // 3),
            "queued.max.messages.kbytes": 4096,
            # A fetch that finds nothing waits this long at the broker; some
            # brokers hold it that long even when a message arrives, which
            # delayed every retry and every turn submitted to an idle worker.
            "fetch.wait.max.ms": 100,
        }
        self._admin = TopicAdmin(base, topic, group, timeout_s)
        try:
            self.partitions = self._admin.ensure(self.wanted_partitions)
        except BaseException:
            self._admin.close()
            raise
        self.producer = CoalescingProducer(
            base,
            topic,
            flush_timeout_s=timeout_s,
            linger_s=linger_s,
            coalesce=coalesce,
            on_failure=self._reensure,
        )
        self._lock = threading.Lock()
        self._consumers: dict[str, OwnedConsumer] = {}
        self._relays: dict[int, GroupCommit[int]] = {}
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        self.handoffs = 0
        self.rejoins = 0
        # A consumer that saw no rebalance this long after an outage rejoins.
        self.rejoin_s = max(2.0, session_timeout_ms / 1000)
        # A group stalled this long with lag, none of it here, is rejoined.
        self.stall_s = 2 * session_timeout_ms / 1000 if stall_s is None else stall_s
        self._stall = StallWatch(self.stall_s)
        self._watcher: threading.Thread | None = None
        self._probed_at: float | None = None  # the last probe the broker answered
        self.auto_relay_s = 0.1
        self._outbox: Outbox | None = None
        self._relayer: threading.Thread | None = None
        self._relay_wake = threading.Event()
        self._closed = False
        self._retired = {"assignments": 0, "revocations": 0}
        # Per owner: the outage (last seen, began) of a consumer that rejoined
        # the group after it, for the consumer made next (see :meth:`_rejoin`).
        self._outages: dict[str, tuple[float | None, float | None]] = {}
        # While a consumer has no assignment after an outage, or is starved
        # (assigned, fetching nothing), its owner claims ready items from the
        # store (see :mod:`.direct`).
        self._direct = DirectClaims()
        # Monotonic: until when a busy Kafka delivery is likely a turn claimed
        # from the store (short: retried soon, not held a whole lease).
        self._direct_until = float("-inf")

    @property
    def redeliver_after_s(self) -> float:
        """How long a published, unrun item may wait before the reconciler
        re-publishes it. A message still in the log is not lost, and a copy
        lands behind it (same key, same partition): re-publishing a healthy
        backlog every TTL only lengthened the log, several copies per item
        after a broker restart. So an item waits until the group has consumed
        past a probe of the log taken after its publish, or the broker lost
        the log that probe saw (:class:`Drained`): each stranded item goes
        out again once. At least about a TTL (a second for an item published
        before the last probe of a log the broker lost); at most twice a TTL plus twice
        the time the group needs to consume its slowest partition's backlog
        at its recent rate, plus ``stall_s`` while the group consumes nothing
        from a partition with a backlog (rejoining, or wedged: its items go
        out again that often). A process that has not probed the group yet
        waits twice a TTL plus ``stall_s`` (it would re-publish a whole
        healthy backlog)."""
        now = time.monotonic()
        base = self._redeliver_base_s
        if not self._drained.probed:
            # A process just started (or restarted by a supervisor) knows
            # nothing of the log yet: it re-published the whole backlog, which
            # the group had all along. Its consumers' first probe tells, at
            # once; the bound keeps a process whose probes fail from holding
            # stranded items back for long.
            return 2 * base + self.stall_s
        # A backlog the group is not consuming: a rejoin after a restart
        # (no copy would run sooner), or an assignment the broker wedged
        # (the stall watch rejoins after stall_s); copies wait that long.
        stalled = self.stall_s if self._backlog.stalled(now) else 0.0
        cap = min(Backlog.MAX_WAIT_S, 2 * base + self._backlog.wait_s(now) + stalled)
        cutoff = self._drained.cutoff()
        if cutoff is None:  # the group has not caught up with any probe yet
            return max(base, cap)
        # Store and broker clocks may differ a little: a copy too many is the
        # price of a margin too small, never a lost item.
        margin = min(base, PUBLISH_MARGIN_S)
        wait = max(base, min(cap, now - cutoff + margin))
        lost = self._drained.lost_at
        if lost is not None:
            # An item published before a log the broker lost is gone for
            # certain: out again at once, so its copy waits in the new log
            # while the group rejoins, not a TTL after its last publish.
            edge = lost - margin
            if self._outage_edge is not None and self._outage_edge > edge:
                edge = self._outage_edge
            wait = min(wait, max(margin, now - edge))
        return wait

    @redeliver_after_s.setter
    def redeliver_after_s(self, value: float) -> None:
        self._redeliver_base_s = value

    @property
    def _watch_every_s(self) -> float:
        # Often enough that the redelivery cutoff (Drained) follows the group
        # within a fraction of a TTL.
        return max(0.5, min(self.stall_s / 4, self._redeliver_base_s / 2))

    # -- health and admission ---------------------------------------------------
    def ping(self) -> None:
        """Raise unless the broker answers and the topic has its partitions
        (re-creating a topic a broker lost; a broker that cannot grow raises)."""
        self.partitions = self._admin.ensure(self.wanted_partitions)

    def _reensure(self) -> None:
        try:
            self.partitions = self._admin.ensure(self.wanted_partitions)
        except TaskQueueUnavailable as exc:
            log.warning("topic check failed: %s", exc)

    def depth(self) -> int:
        """Consumer-group lag (authoritative; raises :class:`DepthUnavailable`)."""
        return self._admin.lag()

    def admit(self, n: int, max_depth: int) -> None:
        """Reject before anything is stored or produced when the lag plus ``n``
        would exceed the bound; an unknown lag rejects too."""
        try:
            lag = self.depth()
        except TopicMissing:
            # A restarted broker that lost its log: re-create the topic (an
            # empty one has no lag) rather than refuse every submission until
            # a failed publish does it.
            self.ping()
            lag = self.depth()
        if lag + n > max_depth:
            raise QueueFull(f"queue full: {lag} unconsumed turns on Kafka, bound AGENT_DISPATCH_MAX_DEPTH={max_depth}")

    # -- publishing ------------------------------------------------------------------
    def put(self, envelope: Envelope) -> None:
        """Publish one envelope; returns after the broker confirmed it."""
        self.put_many([envelope])

    def put_many(self, envelopes: Sequence[Envelope], seqs: Sequence[int | None] | None = None) -> None:
        """Publish a batch behind one delivery-confirmed flush. ``seqs`` (the
        items' session order) ride in a header: a consumer orders a session's
        messages by it, since a retry lands behind the turns that follow it."""
        order = seqs if seqs is not None else [None] * len(envelopes)
        self.producer.put_many(
            [
                (
                    message_key(e.session_id, e.tenant),
                    e.to_json().encode(),
                    None if seq is None else [(SEQ_HEADER, str(seq).encode())],
                )
                for e, seq in zip(envelopes, order, strict=True)
            ]
        )

    def relay(self, store: Outbox) -> int:
        """Publish the store's outbox; concurrent callers share one round.
        Returns after every row committed before the call is confirmed (or
        raises; the rows then stay and the next relay retries them), except
        rows another process's relay took less than ``relay_hold_s`` ago:
        that relay publishes them (and this one too once the hold is over)."""
        with self._lock:
            gate = self._relays.setdefault(id(store), GroupCommit())
            self._outbox = store
        try:
            # Waiting for others' rounds is bounded; our own round is bounded
            # by the producer's flush timeout.
            return gate.run(lambda: self._drain(store), timeout_s=self.timeout_s)
        except TimeoutError:
            raise TaskQueueUnavailable(
                f"publishing to Kafka did not finish within {self.timeout_s:g} s; "
                "stored turns stay in the outbox and the reconciler publishes them"
            ) from None

    def _auto_relay(self) -> None:
        # A fenced commit that schedules a retry, or releases dependants, writes
        # outbox rows that nobody publishes until the next reconciler pass; a
        # background relay publishes them promptly (rate-limited), best effort,
        # so a consumer never waits on a flush (or on a dead broker).
        if self._outbox is None:
            return
        with self._lock:
            if self._relayer is None and not self._closed:
                self._relayer = threading.Thread(target=self._relay_loop, name="kafka-relay", daemon=True)
                self._relayer.start()
        self._relay_wake.set()

    def _relay_loop(self) -> None:
        while not self._stop.is_set():
            self._relay_wake.wait()
            self._relay_wake.clear()
            store = self._outbox
            if self._stop.is_set() or store is None:
                return
            try:
                self.relay(store)
            except AgentDispatchError as exc:
                log.debug("opportunistic relay failed (the reconciler retries): %s", exc)
            self._stop.wait(self.auto_relay_s)

    def _drain(self, store: Outbox) -> int:
        total = 0
        while True:
            at = time.monotonic()
            if not store.outbox_take(1):
                # Rows are deleted only once confirmed: every row queued
                # before this read is. (A lease is a write: on SQLite it would
                # queue every relay of every process, ten a second each, with
                # the workers' claims, for an empty outbox.)
                self._relayed_through = at
                return total
            rows = store.outbox_lease(self._relayer_id, RELAY_BATCH, self.relay_hold_s)
            if rows:
                self.put_many([r.envelope for r in rows], [r.seq for r in rows])
                store.outbox_done([r.id for r in rows])  # only after delivery
                total += len(rows)
            if len(rows) < RELAY_BATCH:
                # Rows another process's relay holds are its to publish; only
                # an empty outbox says every row queued before is confirmed.
                at = time.monotonic()
                if not store.outbox_take(1):
                    self._relayed_through = at
                return total

    # -- consuming -------------------------------------------------------------------
    def _consumer(self, owner: str) -> OwnedConsumer:
        with self._lock:
            oc = self._consumers.get(owner)
            if oc is None or oc.closed:
                oc = OwnedConsumer(
                    owner, self._consumer_config, self.topic, buffer_max=self.buffer_max, poll_every_s=self.keepalive_s
                )
                # A member made anew for the outage its predecessor saw (see
                # :meth:`_rejoin`) cannot deliver until it is assigned, and
                # may be starved after that, as the predecessor would be.
                oc.outage_at, oc.outage_began = self._outages.pop(owner, (None, None))
                self._consumers[owner] = oc
            if self._keepalive is None:
                self._keepalive = threading.Thread(target=self._keepalive_loop, name="kafka-keepalive", daemon=True)
                self._keepalive.start()
                self._watcher = threading.Thread(target=self._watch_loop, name="kafka-group-watch", daemon=True)
                self._watcher.start()
            return oc

    def prepare(self, owner: str) -> None:
        """Start ``owner``'s consumer joining the group now: a broker holds a
        new group's first JoinGroup for seconds (its initial rebalance delay),
        which then overlaps the worker's start-up instead of its first claims.
        The keepalive serves the assignment until the owner first gets."""
        self._consumer(owner)

    def get(self, owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        """One envelope from ``owner``'s own consumer (created on first use);
        while the group cannot deliver to it (an outage, until it has
        rejoined), what it still holds, else a ready item from the store."""
        self._auto_relay()
        oc = self._consumer(owner)
        store = self._outbox
        # Starved (assigned after an outage, fetching nothing) is bridged
        # until the stall watch could have rejoined the group. A group that
        # stays stalled across rejoins (a broker that keeps answering every
        # join with nothing, a member that holds partitions and consumes
        # nothing) is bridged for as long as it lasts: rejoining alone left
        # the ready turns waiting for good.
        now = time.monotonic()
        if store is not None and (
            oc.stranded(now, bridge_s=self.stall_s + self._watch_every_s)
            or (not oc.assigned and self._stall.stalled_for(now) >= self.stall_s)
        ):
            got = oc.get(visibility_s, 0.0)
            if got is None:
                try:
                    got = self._direct.take(store, owner)
                except Exception as exc:  # the store busy or away: wait on the consumer instead
                    log.debug("reading ready items from the store failed (%s)", type(exc).__name__)
            if got is not None:
                if isinstance(got.receipt.ref, StoreRef):
                    self._direct_until = time.monotonic() + self._redeliver_base_s
                return got
        return oc.get(visibility_s, wait_s)

    def wait(self, timeout_s: float) -> None:
        """Consumers wait inside :meth:`get` (``wait_s``); this only pauses
        briefly, so a caller that gets again does not spin."""
        time.sleep(min(0.05, max(0.0, timeout_s)))

    def _owner_of(self, delivery: Delivery) -> OwnedConsumer | None:
        with self._lock:
            return self._consumers.get(delivery.receipt.owner)

    def ack(self, delivery: Delivery) -> bool:
        """Commit the offset; False when the receipt's consumer no longer owns it
        (another owner's receipt, a revoked partition, a handed-off consumer)."""
        if isinstance(delivery.receipt.ref, StoreRef):
            return True  # claimed from the store: no message to commit past
        oc = self._owner_of(delivery)
        done = oc is not None and oc.ack(delivery.receipt)
        self._auto_relay()  # the commit before this ack may have written outbox rows
        return done

    def get_many(self, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
        return get_each(self, owner, n, visibility_s=visibility_s)

    def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """:meth:`ack` for each, one offset commit per consumer."""
        by_owner: dict[str, list[int]] = {}
        out = [False] * len(deliveries)
        for i, d in enumerate(deliveries):
            if isinstance(d.receipt.ref, StoreRef):
                out[i] = True  # claimed from the store: no message to commit past
            else:
                by_owner.setdefault(d.receipt.owner, []).append(i)
        for owner, idx in by_owner.items():
            with self._lock:
                oc = self._consumers.get(owner)
            if oc is None:
                continue
            for i, ok in zip(idx, oc.ack_many([deliveries[i].receipt for i in idx]), strict=True):
                out[i] = ok
        self._auto_relay()  # the commits before these acks may have written outbox rows
        return out

    def release(self, delivery: Delivery, delay_s: float) -> None:
        """Hold the message, uncommitted, in its consumer for ``delay_s``
        (briefly while turns are claimed from the store: a busy item is then
        likely one of them, which ends soon, and its session waits behind
        it in the consumer)."""
        if isinstance(delivery.receipt.ref, StoreRef):
            return  # read from the store: it is ready there, nothing to give back
        if time.monotonic() < self._direct_until:
            delay_s = min(delay_s, DIRECT_BUSY_S)
        oc = self._owner_of(delivery)
        if oc is not None:
            oc.release(delivery.receipt, delay_s)

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(min(0.5, self.keepalive_s)):
            with self._lock:
                consumers = list(self._consumers.values())
            now = time.monotonic()
            for oc in consumers:
                try:
                    if oc.lost_group(now, self.rejoin_s):
                        self._rejoin(oc)
                        continue
                    oc.keepalive(now, self.keepalive_s, self._handoff)
                except Exception as exc:  # keep the thread alive; the owner sees errors itself
                    log.warning("keepalive poll failed (%s)", type(exc).__name__)

    def _watch_loop(self) -> None:
        # Its own thread: the probe may wait on the broker, which must not
        # delay the keepalive polls.
        every = self._watch_every_s
        wait = 0.0  # the first probe at once: until then re-publication waits longer
        while not self._stop.wait(wait):
            wait = every
            try:
                self._watch_once()
            except Exception:
                # The stall watch is what gets a wedged group consuming again:
                # its thread must outlive anything a probe runs into.
                log.warning("the consumer group watch failed a round", exc_info=True)

    def _watch_once(self) -> None:
        """One round: probe the group, rejoin it if it stalled, then follow
        what the group has consumed (the redelivery cutoff)."""
        with self._lock:
            consumers = [oc for oc in self._consumers.values() if not oc.closed]
        if not consumers:
            return
        started = time.monotonic()
        # Read before the probe: an outbox empty now means every item queued
        # before ``started`` has its message below the watermarks read next.
        relayed = self._outbox_empty_at(started)
        try:
            positions = self._admin.positions()
        except TopicMissing:
            # A restarted broker that lost its log: re-create the topic now,
            # so the consumers' next metadata refresh finds it, rather than
            # when a publish of this process fails (its flush timeout later).
            # The items of the old log go out again at the next pass, while
            # the group still rejoins, not after the next probe.
            if self._outage_since_probe(consumers) and self._drained.gone():
                self._mark_lost(consumers)
            self._reensure()
            self._lost_log()
            return
        except AgentDispatchError:
            return  # unreachable: nothing to consume yet
        previous, self._probed_at = self._probed_at, started
        holding = any(oc.assigned for oc in consumers)
        # The stall decision first, on the broker's own answer, exactly as
        # without the cutoff: nothing below may delay or prevent a rejoin.
        if self._stall.observe(time.monotonic(), positions, holding):
            log.warning("the consumer group made no progress with turns waiting: rejoining the group")
            for oc in consumers:
                self.rejoins += 1
                self._retire(oc)
        ends: dict[int, int] = {}
        for oc in consumers:
            for p, end in oc.log_ends().items():
                ends[p] = max(end, ends.get(p, end))
        seen = with_ends(positions, ends)
        self._backlog.observe(time.monotonic(), seen)
        # An item queued after the last emptying relay may be published after
        # this probe (an outbox row left by an outage, published late): it is
        # covered from that relay on, not from the probe.
        if relayed is not None and self._drained.observe(min(started, relayed), seen, positions):
            self._mark_lost(consumers)
            # A client made since the previous probe, which saw the old log
            # (on TopicMissing, or a failed publish), is of the new one.
            self._lost_log(older_than=previous)

    def _outage_since_probe(self, consumers: list[OwnedConsumer]) -> bool:
        # A topic missing from one metadata answer, with no outage seen since
        # the last probe (a topic deleted by hand, a broker's transient
        # error), is left to the next probe, whose offsets tell.
        probed = self._probed_at
        return probed is not None and any(oc.outage_began is not None and oc.outage_began > probed for oc in consumers)

    def _mark_lost(self, consumers: list[OwnedConsumer]) -> None:
        """The broker lost the log the last probe saw. Every item queued
        before the outage that followed that probe began had its message
        confirmed in that log (or still waited in the outbox: a copy too
        many). The last probe alone left out what was published between it
        and the crash, up to a probe interval: those items waited until the
        group had consumed the whole new log, the end of the drain."""
        lost = self._drained.lost_at
        now = time.monotonic()
        began = [oc.outage_began for oc in consumers if oc.outage_began is not None]
        self._outage_edge = None
        if lost is not None and began and lost < max(began) <= now:
            self._outage_edge = max(began)

    def _lost_log(self, older_than: float | None = None) -> None:
        # The broker lost its log, and the producer's state with it: publish
        # the outbox (and the reconciler's re-publications) on a new client
        # now, not once the old client's messages have timed out.
        self.producer.renew(older_than)
        self._auto_relay()

    def _outbox_empty_at(self, now: float) -> float | None:
        """The latest time every item queued before it had its message
        confirmed: the last emptying relay round of this process, or ``now``
        if the outbox is empty now (another process relayed it)."""
        store = self._outbox
        if store is not None:
            try:
                if not store.outbox_take(1):
                    self._relayed_through = now
            except Exception:  # the group watch must outlive a store error (locked, disk full)
                pass  # the last relay round tells
        return self._relayed_through

    def _rejoin(self, oc: OwnedConsumer) -> None:
        log.warning("a Kafka consumer saw no rebalance after the brokers came back: rejoining the group")
        self.rejoins += 1
        with self._lock:
            self._outages[oc.owner] = (oc.outage_at, oc.outage_began)
        self._retire(oc)

    def _handoff(self, oc: OwnedConsumer) -> None:
        log.info("a delivery outlived its visibility: handing its partitions to other consumers")
        self.handoffs += 1
        self._retire(oc)

    def _retire(self, oc: OwnedConsumer) -> None:
        # The owner's next get creates a new consumer (a new group member).
        oc.close()
        for k, v in oc.stats().items():
            if k in self._retired:
                self._retired[k] += v
        with self._lock:
            if self._consumers.get(oc.owner) is oc:
                del self._consumers[oc.owner]

    def stats(self) -> dict[str, int]:
        """Counters: flushes, messages, relay rounds, consumers, rebalances."""
        with self._lock:
            consumers = list(self._consumers.values())
            relays = sum(g.rounds for g in self._relays.values())
        per = [oc.stats() for oc in consumers]
        return {
            "flushes": self.producer.flushes,
            "messages": self.producer.messages,
            "relay_rounds": relays,
            "consumers": len(consumers),
            "assignments": self._retired["assignments"] + sum(s["assignments"] for s in per),
            "revocations": self._retired["revocations"] + sum(s["revocations"] for s in per),
            "handoffs": self.handoffs,
            "rejoins": self.rejoins,
            "direct": self._direct.handed,
        }

    def close(self) -> None:
        """Stop the keepalive, leave the group, flush and close clients (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._relay_wake.set()
        for t in (self._keepalive, self._relayer, self._watcher):
            if t is not None:
                t.join(timeout=5)
        with self._lock:
            consumers = list(self._consumers.values())
            self._consumers.clear()
        for oc in consumers:
            oc.close()
        self.producer.close()
        self._admin.close()
