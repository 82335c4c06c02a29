"""Delivery-confirmed publishing for the Kafka transport.

Group commit: callers that arrive while a flush is running join the *next*
round, so N concurrent ``put`` calls cost one flush (plus at most the one in
progress), and ``put_many`` costs one flush for the whole batch. A caller
returns only after the broker confirmed every one of its messages
(idempotent producer, ``acks=all``); a failure raises to that caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from confluent_kafka import KafkaError, Producer

from ...errors import TaskQueueUnavailable

log = logging.getLogger("agentdispatch.kafka")

T = TypeVar("T")

#: Message headers: name and value pairs, or None.
Headers = list[tuple[str, str | bytes | None]] | None
#: One message to publish: key, value, headers.
Record = tuple[bytes, bytes, Headers]

#: A key that only spreads messages over partitions; it is not a secret (the
#: envelope in the value carries the ids anyway), it just keeps names out of keys.
_KEY_SALT = b"agentdispatch.kafka.key.v1"


def message_key(session_id: str | None, tenant: str | None) -> bytes:
    """``session:<opaque ref>``; a session outranks the tenant, so all turns
    of one session land on one partition (serial) while sessions spread."""
    if session_id:
        # The session id alone: same-named sessions of two tenants share a
        # partition, which costs nothing and keeps any reading of "session" serial.
        kind, parts = "session", (session_id,)
    elif tenant:
        kind, parts = "tenant", (tenant,)
    else:
        return b"none"
    digest = hashlib.blake2b("\x1f".join(parts).encode(), key=_KEY_SALT, digest_size=12).hexdigest()
    return f"{kind}:{digest}".encode()


class _Round(Generic[T]):
    __slots__ = ("error", "finished", "result")

    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None
        self.result: T | None = None


class GroupCommit(Generic[T]):
    """Single-flight execution: every caller's precondition (a produced message,
    a committed outbox row) happened before the round that serves it started."""

    def __init__(self, linger_s: float = 0.0) -> None:
        self.linger_s = linger_s
        self.rounds = 0
        self._cond = threading.Condition()
        self._next: _Round[T] = _Round()
        self._running = False

    def run(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Join the next round (leading it when nobody runs); return its result.
        A caller that waits for others' rounds longer than ``timeout_s`` gets
        :class:`TimeoutError` (its round still runs, led by a later caller)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            rnd = self._next
            while not rnd.finished:
                if not self._running:
                    self._running = True
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"the round did not finish within {timeout_s:g} s")
                self._cond.wait(remaining)
            else:
                if rnd.error is not None:
                    raise rnd.error
                return rnd.result  # type: ignore[return-value]
        if self.linger_s > 0:
            time.sleep(self.linger_s)  # let concurrent callers join this round
        with self._cond:
            self._next = _Round()  # later arrivals wait for the next round
        try:
            rnd.result = fn()
        except BaseException as exc:
            rnd.error = exc
        with self._cond:
            rnd.finished = True
            self._running = False
            self.rounds += 1
            self._cond.notify_all()
        if rnd.error is not None:
            raise rnd.error
        return rnd.result  # type: ignore[return-value]


class _Batch:
    """Delivery reports of one caller's messages (fired on the flushing thread)."""

    def __init__(self, n: int) -> None:
        self.pending = n
        self.errors: list[str] = []
        # Re-entrant: a report can fire inside a report on the same thread (a
        # discarded client, collected there, serves the reports of its purged
        # messages), and a plain lock then hung the publishing caller for good.
        self._lock = threading.RLock()

    def report(self, err: KafkaError | None, _msg: Any) -> None:
        with self._lock:
            self.pending -= 1
            if err is not None:
                self.errors.append(err.name())


class CoalescingProducer:
    """An idempotent, ``acks=all`` producer whose callers share flushes."""

    def __init__(
        self,
        config: dict[str, Any],
        topic: str,
        *,
        flush_timeout_s: float,
        linger_s: float = 0.0,
        coalesce: bool = True,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.topic = topic
        self.flush_timeout_s = flush_timeout_s
        self.coalesce = coalesce
        self.on_failure = on_failure
        conf = {
            **config,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 1,
            # Fail definitively at the flush deadline, so a caller that saw an
            # error does not also see the message appear much later.
            "message.timeout.ms": int(flush_timeout_s * 1000),
        }
        self._conf = conf
        self._p = Producer(conf)
        self._made_at = time.monotonic()
        self.resets = 0
        self._gate: GroupCommit[None] = GroupCommit(linger_s)
        self._serial = threading.RLock()
        self._checking = threading.Lock()
        self.messages = 0
        self._flushes_serial = 0

    @property
    def flushes(self) -> int:
        """Delivery-confirmed flushes so far (tests assert coalescing with it)."""
        return self._gate.rounds + self._flushes_serial

    def put(self, key: bytes, value: bytes, headers: Headers = None) -> None:
        """Publish one message; returns once the broker confirmed it."""
        self.put_many([(key, value, headers)])

    def put_many(self, records: Sequence[Record]) -> None:
        """Publish a batch behind one delivery-confirmed flush."""
        if not records:
            return
        batch = _Batch(len(records))
        client = self._p  # the client this batch goes to; a reset replaces it once
        if not self.coalesce:  # the benchmark's baseline: one flush per call
            with self._serial:
                self._produce(client, records, batch)
                self._flush()
                self._flushes_serial += 1
        else:
            self._produce(client, records, batch)
            # The round in progress and ours, each bounded by the flush timeout;
            # on a timeout _check reports the unconfirmed messages.
            with contextlib.suppress(TimeoutError):
                self._gate.run(self._flush, timeout_s=2 * self.flush_timeout_s)
        self._check(client, batch)

    def _produce(self, client: Producer, records: Sequence[Record], batch: _Batch) -> None:
        deadline = time.monotonic() + self.flush_timeout_s
        for key, value, headers in records:
            while True:
                try:
                    client.produce(self.topic, value=value, key=key, headers=headers, on_delivery=batch.report)
                    break
                except BufferError:
                    # Local queue full: serve reports and retry, but not for
                    # ever (a dead broker leaves the queue full until timeouts).
                    if time.monotonic() >= deadline:
                        raise TaskQueueUnavailable(
                            f"Kafka's local queue stayed full for {self.flush_timeout_s:g} s (broker unreachable?)"
                        ) from None
                    client.poll(0.05)
                except Exception as exc:  # KafkaException: never echo its text
                    # A fatal error (the idempotent producer's state lost by a
                    # restarted broker) leaves this client useless: replace it.
                    self._reset(client)
                    raise TaskQueueUnavailable(f"Kafka refused the message ({type(exc).__name__})") from None
        self.messages += len(records)

    def _flush(self) -> None:
        try:
            self._p.flush(self.flush_timeout_s)
        except Exception as exc:  # a fatal client error surfaces here too
            # The callers' _check sees their messages unconfirmed and resets.
            log.debug("Kafka flush failed (%s)", type(exc).__name__)

    def _check(self, client: Producer, batch: _Batch) -> None:
        if batch.pending or batch.errors:
            self._reset(client)
            self._after_failure()
        if batch.pending > 0:
            raise TaskQueueUnavailable(
                f"Kafka did not confirm {batch.pending} message(s) within {self.flush_timeout_s:g} s"
            )
        if batch.errors:
            codes = sorted(set(batch.errors))
            raise TaskQueueUnavailable(f"Kafka delivery failed for {len(batch.errors)} message(s): {', '.join(codes)}")

    def _after_failure(self) -> None:
        # A broker that lost its log lost the topic too; messages for a missing
        # topic just time out, so check the topic on any failure -- in the
        # background: the caller already waited its flush timeout.
        if self.on_failure is None or not self._checking.acquire(blocking=False):
            return
        on_failure = self.on_failure

        def check() -> None:
            try:
                on_failure()
            finally:
                self._checking.release()

        threading.Thread(target=check, name="kafka-topic-check", daemon=True).start()

    def renew(self, older_than: float | None = None) -> None:
        """Start over with a new client now, unless the current one was made
        after ``older_than`` (monotonic): the broker lost its state (a
        restart without persistent storage, the topic gone). The idempotent
        producer's id went with it, and a broker may refuse the old client's
        messages until they time out; waiting for that held every publish
        back for a whole flush timeout after the broker was back."""
        if older_than is None or self._made_at <= older_than:
            self._reset(self._p)

    def _reset(self, client: Producer) -> None:
        # A restarted broker may have lost the idempotent producer's state (and
        # the old client keeps waiting on it): start over with a new producer,
        # once per failed client (every caller of a failed round reports it;
        # only the first replaces it, so no caller purges a fresh client).
        # Callers whose messages sat in the old one get their error.
        with self._serial:
            if self._p is not client:
                return
            self._p = Producer(self._conf)
            self._made_at = time.monotonic()
            self.resets += 1
        with contextlib.suppress(Exception):
            client.purge()
            client.flush(0)

    def close(self) -> None:
        """Flush what is left (bounded) and drop the client."""
        self._p.flush(min(self.flush_timeout_s, 5.0))
