"""Prometheus series (SPEC section 8; reference in docs/metrics.md).

Two kinds, so that every scrape tells the same truth:

* :class:`Metrics`: what *this process* did (turns it ran, their durations,
  its lease failures), one private registry per process object. Sum them over
  every worker target in PromQL.
* :class:`FleetCollector`: the state of the whole fleet (depth, live workers,
  dead letters, turns in flight), read from the store at scrape time, so the
  gateway's ``/metrics`` and any worker's ``--metrics-port`` agree.

The gateway also serves the fleet's sum of some per-process series (turns by
outcome, redeliveries, lease failures, time in queue, attempts) under the same
names with ``scope="fleet"``: each worker publishes its counts in its heartbeat
row (:meth:`Metrics.published`), and the store adds a removed row's last
counts into a fleet total in the transaction that removes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from .fleet import LIVE_FOR_S
from .probe import Probe
from .stores.base import Horizon

if TYPE_CHECKING:
    from .stores.base import Fleet
    from .transports.base import Transport

log = logging.getLogger("agentdispatch.metrics")

PREFIX = "agent_utilities_dispatch_"

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

#: How a handler run ended, by kind (``runs_total``).
RUN_RESULTS = ("ok", "error", "timeout", "lost")

#: Per-process series a gateway serves (the rest only mean something in a worker).
GATEWAY_SERIES = frozenset({PREFIX + "intake_backlog_full"})

TIME_IN_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 1800)
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 7, 10, 20)

#: The label the gateway's fleet-wide sums carry (workers' own series have
#: none), so that a query picks one kind and never adds both.
SCOPE = "fleet"


class Metrics:
    """The per-process series, registered on a private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.turns = Counter(PREFIX + "turns", "Processed turns by outcome", ["outcome"], registry=r)
        self.runs = Counter(
            PREFIX + "runs", "Handler runs by kind and result: ok, error, timeout, lost", ["kind", "result"], registry=r
        )
        self.run_seconds = Histogram(
            PREFIX + "run_duration_seconds",
            "Handler run time, claim to outcome, by kind",
            ["kind"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
            registry=r,
        )
        self.time_in_queue = Histogram(
            PREFIX + "time_in_queue_seconds", "Enqueue to claim", buckets=TIME_IN_QUEUE_BUCKETS, registry=r
        )
        self.attempts = Histogram(PREFIX + "attempts", "Attempt number at claim", buckets=ATTEMPT_BUCKETS, registry=r)
        self.commit_batch = Histogram(
            PREFIX + "commit_batch_turns",
            "Turns committed by one worker commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.redeliveries = Counter(PREFIX + "redeliveries", "Deliveries after the first", registry=r)
        self.lease_failures = Counter(PREFIX + "lease_failures", "Renewals or commits refused", registry=r)
        self.worker_errors = Counter(
            PREFIX + "worker_errors",
            "Store or transport errors a claim thread backed off from, by exception class",
            ["error"],
            registry=r,
        )
        self.intake_backlog_full = Counter(
            PREFIX + "intake_backlog_full",
            "Intake updates answered 503 because their agent's open-item bound was reached",
            ["connector"],
            registry=r,
        )
        self.in_flight = Gauge(PREFIX + "in_flight", "Turns running in this worker", registry=r)
        self.concurrency_limit = Gauge(
            PREFIX + "concurrency_limit",
            "Turns this worker may run at once (lowered while a handler reports overload)",
            registry=r,
        )
        self.renew_lateness = Gauge(
            PREFIX + "renew_lateness_max_seconds",
            "Worst delay of a lease renewal past its due time since the worker started",
            registry=r,
        )
        self.renew_late = Histogram(
            PREFIX + "renew_lateness_seconds",
            "Delay of each batch of lease renewals past its due time",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        for outcome in OUTCOMES:
            self.turns.labels(outcome=outcome)

    def render(self) -> bytes:
        """The Prometheus text exposition of this process's series."""
        return generate_latest(self.registry)

    def published(self) -> dict[str, float]:
        """What a worker writes into its heartbeat row: the cumulative values
        of the series the gateway sums over the fleet, by :func:`series_key`
        (zeros left out: a key that is missing reads 0)."""
        out: dict[str, float] = {}
        for metric in (self.turns, self.redeliveries, self.lease_failures, self.time_in_queue, self.attempts):
            for family in metric.collect():
                for sample in family.samples:
                    if sample.value and not sample.name.endswith("_created"):
                        label = sample.labels.get("outcome", sample.labels.get("le"))
                        out[series_key(sample.name, label)] = sample.value
        return out


def series_key(name: str, label: str | None = None) -> str:
    """A sample's key in the published counts: its name without the prefix,
    and the value of its one label (``outcome`` or ``le``) after a colon."""
    short = name.removeprefix(PREFIX)
    return short if label is None else f"{short}:{label}"


def fleet_families(totals: Mapping[str, float]) -> Iterator[Metric]:
    """The fleet's sums of the published series (:meth:`Metrics.published`),
    labelled ``scope="fleet"``; a key no worker published reads 0."""
    turns = CounterMetricFamily(
        PREFIX + "turns", "Processed turns by outcome, every worker (scope=fleet)", labels=["outcome", "scope"]
    )
    for outcome in OUTCOMES:
        turns.add_metric([outcome, SCOPE], totals.get(series_key(PREFIX + "turns_total", outcome), 0.0))
    yield turns
    counters = (("redeliveries", "Deliveries after the first"), ("lease_failures", "Renewals or commits refused"))
    for name, doc in counters:
        family = CounterMetricFamily(PREFIX + name, f"{doc}, every worker (scope=fleet)", labels=["scope"])
        family.add_metric([SCOPE], totals.get(series_key(PREFIX + name + "_total"), 0.0))
        yield family
    for name, doc, bounds in (
        ("time_in_queue_seconds", "Enqueue to claim", TIME_IN_QUEUE_BUCKETS),
        ("attempts", "Attempt number at claim", ATTEMPT_BUCKETS),
    ):
        yield _fleet_histogram(name, f"{doc}, every worker (scope=fleet)", bounds, totals)


def _fleet_histogram(name: str, doc: str, bounds: Iterable[float], totals: Mapping[str, float]) -> Metric:
    count = totals.get(series_key(PREFIX + name + "_count"), 0.0)
    buckets: list[tuple[str, float]] = []
    below = 0.0
    for bound in bounds:
        # Running maximum, capped by the count: rows of a release with other
        # bounds (which lack some keys) still give cumulative buckets.
        le = repr(float(bound))  # as prometheus_client writes these bounds
        below = min(count, max(below, totals.get(series_key(PREFIX + name + "_bucket", le), 0.0)))
        buckets.append((le, below))
    buckets.append(("+Inf", count))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["scope"])
    family.add_metric([SCOPE], buckets, sum_value=totals.get(series_key(PREFIX + name + "_sum"), 0.0))
    return family


#: Seconds a scrape waits for the transport's depth: a Kafka broker that is
#: down holds the read for the client's own timeout, past Prometheus' default
#: 10 s scrape timeout, and the whole scrape would be lost with it.
DEPTH_TIMEOUT_S = 2.0


class FleetCollector:
    """Fleet gauges read from the store and transport at scrape time.

    ``tenant`` limits the per-tenant series to one tenant (a tenant's token);
    None shows every tenant (the operator). ``counters`` adds the fleet's sums
    of the workers' turn series (:func:`fleet_families`: the gateway's
    operator scrape). A store that cannot be read gives ``store_up 0`` and no
    fleet series instead of a failed scrape; a transport that does not tell
    its depth within :data:`DEPTH_TIMEOUT_S` gives ``transport_up 0`` and no
    depth, and the store's series stay."""

    def __init__(
        self,
        backends: Callable[[], tuple[Fleet, Transport]],
        *,
        tenant: str | None = None,
        counters: bool = False,
        clock: Callable[[], float] = time.time,
        depth: Probe[int] | None = None,
    ) -> None:
        self.backends = backends
        self.tenant = tenant
        self.counters = counters
        self.clock = clock
        #: Shared by the scrapes of one transport (a collector per scrape passes it).
        self._depth: Probe[int] = depth if depth is not None else Probe("depth")

    def collect(self) -> Iterator[Metric]:
        """The fleet series (prometheus_client's collector protocol)."""
        try:
            store, transport = self.backends()
            fleet = list(self._fleet(store))
        except Exception as exc:  # a scrape reports an outage, it does not fail
            log.warning("fleet metrics unavailable: %s", type(exc).__name__)
            yield _up("store_up", "1 when this scrape could read the store", False)
            return
        yield _up("store_up", "1 when this scrape could read the store", True)
        yield from fleet
        yield from self._depth_series(transport)

    def _depth_series(self, transport: Transport) -> Iterator[Metric]:
        doc = f"1 when this scrape read the transport's depth within {DEPTH_TIMEOUT_S:g} s"
        try:
            n = self._depth.start(transport.depth).result(timeout=DEPTH_TIMEOUT_S)
        except Exception as exc:  # FutureTimeout too: a broker that does not answer
            log.warning("queue depth unavailable: %s", type(exc).__name__)
            yield _up("transport_up", doc, False)
            return
        yield _up("transport_up", doc, True)
        depth = GaugeMetricFamily(
            PREFIX + "queue_depth", "Unclaimed envelopes on the transport (every tenant)", labels=["backend"]
        )
        depth.add_metric([transport.name], n)
        yield depth

    def _fleet(self, store: Fleet) -> Iterator[Metric]:
        rows = store.workers(max_age_s=LIVE_FOR_S)
        workers = GaugeMetricFamily(PREFIX + "workers", "Live workers (heartbeat younger than 90 s)")
        workers.add_metric([], len(rows))
        capacity = GaugeMetricFamily(PREFIX + "worker_capacity", "Turns the live workers may run at once")
        capacity.add_metric([], sum(r.capacity for r in rows))
        per: dict[str, dict[str, tuple[int, float]]] = {}
        for c in store.fleet_counts():
            if self.tenant is None or c.tenant == self.tenant:
                per.setdefault(c.tenant, {})[c.status] = (c.n, c.oldest)
        if self.tenant is not None:
            per.setdefault(self.tenant, {})
        now = self.clock()
        tenant_depth = _family("tenant_depth", "Submitted and ready items, by tenant")
        in_flight = _family("turns_in_flight", "Leased and running items, by tenant (every worker)")
        dead = _family("dead_letter", "Items in the dead-letter queue, by tenant")
        oldest = _family("dead_letter_oldest_age_seconds", "Age of the oldest dead-lettered item, by tenant")
        for tenant in sorted(per):
            s = per[tenant]
            n = _sum(s, ("submitted", "ready"))
            tenant_depth.add_metric([tenant], n)
            in_flight.add_metric([tenant], _sum(s, ("leased", "running")))
            n_dead, stamp = s.get("dead_letter", (0, now))
            dead.add_metric([tenant], n_dead)
            oldest.add_metric([tenant], max(0.0, now - stamp) if n_dead else 0.0)
        yield from (workers, capacity, tenant_depth, in_flight, dead, oldest)
        if self.counters:
            yield from fleet_families(store.fleet_counters())
        if isinstance(store, Horizon):
            held = store.oldest_snapshot()
            xmin = GaugeMetricFamily(
                PREFIX + "oldest_xmin_age_seconds",
                "Age of the oldest open transaction of the PostgreSQL database (it keeps vacuum from cleaning up)",
            )
            xmin.add_metric([], held.age_s if held is not None else 0.0)
            yield xmin


def _up(name: str, doc: str, up: bool) -> GaugeMetricFamily:
    """A 0/1 gauge saying whether this scrape could read a backend."""
    return GaugeMetricFamily(PREFIX + name, doc, value=1 if up else 0)


def _family(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=["tenant"])


def _sum(by_status: dict[str, tuple[int, float]], statuses: Iterable[str]) -> int:
    return sum(by_status.get(s, (0, 0.0))[0] for s in statuses)


class Exposition:
    """Several collectors rendered as one scrape; ``only`` keeps the named
    families of the first (a gateway serves none of a worker's series)."""

    def __init__(self, *collectors: CollectorRegistry | FleetCollector, only: frozenset[str] | None = None) -> None:
        self.collectors = collectors
        self.only = only

    def collect(self) -> Iterator[Metric]:
        """Every family of every collector, in order."""
        for i, c in enumerate(self.collectors):
            for family in c.collect():
                if i == 0 and self.only is not None and family.name not in self.only:
                    continue
                yield family

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self)
