"""Prometheus series (SPEC section 8), one registry per process object."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = (
    "completed",
    "failed",
    "retried",
    "dead_letter",
    "skipped",
    "expired",
    "fenced",
    "poison",
    "busy",
    "released",
)


class Metrics:
    """The dispatch series, registered on a private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("agent_utilities_dispatch_queue_depth", "Unclaimed turns", ["backend"], registry=r)
        self.turns = Counter("agent_utilities_dispatch_turns", "Processed turns by outcome", ["outcome"], registry=r)
        self.workers = Gauge("agent_utilities_dispatch_workers", "Live workers (fresh heartbeats)", registry=r)
        self.time_in_queue = Histogram(
            "agent_utilities_dispatch_time_in_queue_seconds",
            "Enqueue to claim",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 1800),
            registry=r,
        )
        self.attempts = Histogram(
            "agent_utilities_dispatch_attempts",
            "Attempt number at claim",
            buckets=(1, 2, 3, 4, 5, 7, 10, 20),
            registry=r,
        )
        self.commit_batch = Histogram(
            "agent_utilities_dispatch_commit_batch_turns",
            "Turns committed by one worker commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.redeliveries = Counter("agent_utilities_dispatch_redeliveries", "Deliveries after the first", registry=r)
        self.lease_failures = Counter(
            "agent_utilities_dispatch_lease_failures", "Renewals or commits refused", registry=r
        )
        self.worker_errors = Counter(
            "agent_utilities_dispatch_worker_errors",
            "Store or transport errors a claim thread backed off from, by exception class",
            ["error"],
            registry=r,
        )
        self.intake_backlog_full = Counter(
            "agent_utilities_dispatch_intake_backlog_full",
            "Intake updates answered 503 because their agent's open-item bound was reached",
            ["connector"],
            registry=r,
        )
        self.in_flight = Gauge("agent_utilities_dispatch_in_flight", "Turns running in this worker", registry=r)
        self.concurrency_limit = Gauge(
            "agent_utilities_dispatch_concurrency_limit",
            "Turns this worker may run at once (lowered while a handler reports overload)",
            registry=r,
        )
        self.renew_lateness = Gauge(
            "agent_utilities_dispatch_renew_lateness_max_seconds",
            "Worst delay of a lease renewal past its due time since the worker started",
            registry=r,
        )
        self.dead_letters = Gauge("agent_utilities_dispatch_dead_letter", "Items in the dead-letter queue", registry=r)
        self.dead_letter_oldest = Gauge(
            "agent_utilities_dispatch_dead_letter_oldest_age_seconds",
            "Age of the oldest dead-lettered item",
            registry=r,
        )
        for outcome in OUTCOMES:
            self.turns.labels(outcome=outcome)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
