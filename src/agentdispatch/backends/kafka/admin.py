"""Topic bootstrap (grow-only partitions) and the consumer-group lag probe.

Every error message names settings, never endpoints or credentials: the text
of a librdkafka exception can contain broker addresses, so only error codes
(``KafkaError.name()``) are ever shown.
"""

from __future__ import annotations

import threading
import time
from enum import StrEnum
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic  # type: ignore[attr-defined]

from ...errors import DepthUnavailable, TaskQueueUnavailable

UNREACHABLE = "Kafka is unreachable: check KAFKA_BOOTSTRAP_SERVERS and that the broker is running"


class TopicMissing(DepthUnavailable):
    """The broker answers but has no such topic (a broker that lost its log)."""


class Plan(StrEnum):
    """What start-up must do to the topic."""

    CREATE = "create"
    GROW = "grow"
    OK = "ok"


def partition_plan(current: int | None, wanted: int) -> Plan:
    """Grow-only: create when missing, grow when fewer, never shrink."""
    if current is None:
        return Plan.CREATE
    return Plan.GROW if current < wanted else Plan.OK


def cannot_grow(topic: str, current: int, wanted: int, code: str) -> TaskQueueUnavailable:
    """The clear error of a broker that cannot add partitions."""
    return TaskQueueUnavailable(
        f"topic {topic} has {current} partition(s) but AGENT_TURNS_PARTITIONS={wanted}, and the broker "
        f"refused to add partitions ({code}); add them with your Kafka tooling, or set "
        f"AGENT_TURNS_PARTITIONS={current} (partitions are never shrunk)"
    )


def _code(exc: BaseException) -> str:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return str(exc.args[0].name())
    return type(exc).__name__


class TopicAdmin:
    """Metadata, topic creation/growth and lag, over one admin client and one
    non-subscribed consumer of the group (it reads committed offsets without
    joining the group)."""

    def __init__(self, config: dict[str, Any], topic: str, group: str, timeout_s: float) -> None:
        self.topic = topic
        self.timeout_s = timeout_s
        self._admin = AdminClient(config)
        self._probe = Consumer({**config, "group.id": group, "enable.auto.commit": False})
        self._lock = threading.Lock()

    def partitions(self, timeout_s: float | None = None) -> int | None:
        """Partition count of the topic, ``None`` when it does not exist.
        Raises :class:`TaskQueueUnavailable` when the broker does not answer."""
        try:
            # All topics: asking for one by name lets some brokers auto-create it
            # with their default partition count.
            md = self._admin.list_topics(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except Exception:
            raise TaskQueueUnavailable(UNREACHABLE) from None
        if not md.brokers:
            raise TaskQueueUnavailable(UNREACHABLE)
        t = md.topics.get(self.topic)
        if t is None or t.error is not None or not t.partitions:
            return None
        return len(t.partitions)

    def ensure(self, wanted: int) -> int:
        """Create or grow the topic to ``wanted`` partitions; returns the count."""
        current = self.partitions()
        plan = partition_plan(current, wanted)
        if plan is Plan.CREATE:
            fut = self._admin.create_topics([NewTopic(self.topic, num_partitions=wanted, replication_factor=-1)])
            try:
                fut[self.topic].result(self.timeout_s)
            except Exception as exc:
                if _code(exc) != "TOPIC_ALREADY_EXISTS":  # another process won the race
                    raise TaskQueueUnavailable(f"could not create topic {self.topic} ({_code(exc)})") from None
            return self._settled(wanted)
        if plan is Plan.GROW:
            assert current is not None
            fut = self._admin.create_partitions([NewPartitions(self.topic, wanted)])
            try:
                fut[self.topic].result(self.timeout_s)
            except Exception as exc:
                raise cannot_grow(self.topic, current, wanted, _code(exc)) from None
            return self._settled(wanted)
        assert current is not None
        return current

    def _settled(self, wanted: int) -> int:
        # Metadata propagates asynchronously after a create; wait briefly.
        for _ in range(50):
            n = self.partitions()
            if n is not None and n >= wanted:
                return n
            threading.Event().wait(0.1)
        raise TaskQueueUnavailable(f"topic {self.topic} did not reach {wanted} partitions")

    def lag(self) -> int:
        """Sum over partitions of high watermark minus committed offset of the
        group. Any failure, or missing metadata, raises :class:`DepthUnavailable`
        -- an unknown depth is never read as an empty queue."""
        return sum(max(0, high - done) for done, high in self.positions().values())

    def positions(self) -> dict[int, tuple[int, int]]:
        """Per partition: the group's committed offset (the log start when
        nothing is committed) and the high watermark. Raises
        :class:`DepthUnavailable` like :meth:`lag`."""
        # One deadline for the whole probe (metadata, committed offsets, each
        # partition's watermarks), so an admission never waits much longer
        # than ``timeout_s`` on a broker that stopped answering.
        deadline = time.monotonic() + self.timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DepthUnavailable(f"Kafka lag unavailable: no answer within {self.timeout_s:g} s")
            return remaining

        with self._lock:
            try:
                n = self.partitions(left())
            except TaskQueueUnavailable:
                raise DepthUnavailable("Kafka lag unavailable: broker unreachable") from None
            if not n:
                raise TopicMissing(f"Kafka lag unavailable: no metadata for topic {self.topic}")
            tps = [TopicPartition(self.topic, p) for p in range(n)]
            try:
                committed = self._probe.committed(tps, timeout=left())
                out: dict[int, tuple[int, int]] = {}
                for tp in committed:
                    if tp.error is not None:
                        raise DepthUnavailable(f"Kafka lag unavailable: {tp.error.name()}")
                    low, high = self._probe.get_watermark_offsets(
                        TopicPartition(self.topic, tp.partition), timeout=left()
                    )
                    done = tp.offset if tp.offset >= 0 else low  # no commit yet: from the start
                    out[tp.partition] = (max(done, low), high)
                return out
            except DepthUnavailable:
                raise
            except Exception as exc:
                raise DepthUnavailable(f"Kafka lag unavailable ({_code(exc)})") from None

    def close(self) -> None:
        """Close the probe consumer."""
        with self._lock:
            self._probe.close()
