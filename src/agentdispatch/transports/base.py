"""The transport seam: moving envelopes (put, get, ack, release, depth)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..stores.base import Outbox


@dataclass(frozen=True)
class Receipt:
    """Proof of one delivery: who claimed it and when. Opaque to callers."""

    owner: str
    claimed_at: float
    ref: Any  # backend-specific: row id, (partition, offset), ...


@dataclass(frozen=True)
class Delivery:
    """One envelope handed to one consumer."""

    raw: str
    receipt: Receipt
    deliveries: int = 1


class Sender(Protocol):
    """The submitting side: admission, the outbox relay, the depth."""

    #: How long a ready item may sit without a queue row before the reconciler
    #: re-enqueues it (short on a shared database; about a TTL on Kafka).
    redeliver_after_s: float

    def admit(self, n: int, max_depth: int) -> None:
        """Extra admission before a submit (Kafka: consumer-group lag). Raise
        :class:`QueueFull` or :class:`DepthUnavailable`. Same-database
        transports admit inside the store's submit transaction instead."""

    def relay(self, store: Outbox) -> int:
        """Publish the store's outbox; returns how many envelopes went out.
        Same-database transports read the store's table directly: 0."""

    def depth(self) -> int:
        """Unclaimed envelopes; raise :class:`DepthUnavailable` when unknown."""


class Receiver(Protocol):
    """The worker's side: receive, acknowledge, give back."""

    def get(self, owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        """Receive one envelope for ``owner`` (each worker thread is an owner)."""

    def get_many(self, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
        """Up to ``n`` envelopes for ``owner`` without waiting, in claim order
        (one statement where the backend can; see :func:`get_each`)."""

    def wait(self, timeout_s: float) -> None:
        """Block until envelopes may have arrived since this thread's last empty
        :meth:`get` (a notification, or the next poll is due), at most
        ``timeout_s``. A hint: the caller gets again."""

    def ack(self, delivery: Delivery) -> bool:
        """Acknowledge; False (and nothing deleted) when the receipt no longer
        owns the delivery."""

    def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """:meth:`ack` for each (one statement where the backend can)."""

    def release(self, delivery: Delivery, delay_s: float) -> None:
        """Give a delivery back, visible again after ``delay_s``."""


@runtime_checkable
class Transport(Sender, Receiver, Protocol):
    """Delivers envelopes at least once: what a backend implements. A caller
    types its transport as the smallest part it uses."""

    name: str

    def ping(self) -> None:
        """Raise :class:`TaskQueueUnavailable` unless the transport answers."""

    def close(self) -> None:
        """Release connections/consumers."""


def get_each(transport: Receiver, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
    """:meth:`Transport.get_many` as one get after another."""
    out: list[Delivery] = []
    while len(out) < n:
        got = transport.get(owner, visibility_s=visibility_s, wait_s=0.0)
        if got is None:
            break
        out.append(got)
    return out


def ack_each(transport: Receiver, deliveries: Sequence[Delivery]) -> list[bool]:
    """:meth:`Transport.ack_many` as one ack after another."""
    return [transport.ack(d) for d in deliveries]
