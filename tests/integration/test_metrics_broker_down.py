"""A scrape while the Kafka broker is down: the store's series stay and the
depth says it is unknown, instead of the whole scrape waiting on the broker
and reporting the store down with it."""

from __future__ import annotations

import threading
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily

from agentdispatch.backends.kafka.transport import KafkaTransport
from agentdispatch.dispatch import Submission
from agentdispatch.gateway import Services, ops
from agentdispatch.metrics import FleetCollector
from agentdispatch.settings import load_settings
from backends import sqlite_harness
from kafka_broker import Broker


def test_a_broker_that_is_down_costs_the_depth_not_the_scrape(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path)
    broker = Broker(tmp_path / "broker").start()
    settings = load_settings(KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap, TASK_QUEUE_BACKEND="kafka")
    kafka = KafkaTransport(settings)
    try:
        h.dispatcher().submit(Submission(kind="echo", tenant="acme"))
        broker.kill()
        fleet = FleetCollector(lambda: (h.store, kafka))
        for _ in range(2):  # the second scrape waits on the first one's depth read, not a new one
            families = {m.name: m for m in fleet.collect() if isinstance(m, GaugeMetricFamily)}
            up = {name: fam.samples[0].value for name, fam in families.items() if name.endswith("_up")}
            assert up == {"agent_utilities_dispatch_store_up": 1, "agent_utilities_dispatch_transport_up": 0}
            assert "agent_utilities_dispatch_queue_depth" not in families
            depth = families["agent_utilities_dispatch_tenant_depth"].samples
            assert [(s.labels, s.value) for s in depth] == [({"tenant": "acme"}, 1)]
        # The gateway builds a collector per scrape: its scrapes share one depth read too.
        services = Services.of(h.settings, h.store, kafka)
        for _ in range(2):
            text = ops.scrape(services, None).decode()
            assert "agent_utilities_dispatch_store_up 1.0" in text
            assert "agent_utilities_dispatch_transport_up 0.0" in text
            assert 'agent_utilities_dispatch_tenant_depth{tenant="acme"} 1.0' in text
        # The collector's read above and the gateway's one (each lasts the broker's 10 s timeout).
        assert sum(t.name == "probe-depth" for t in threading.enumerate()) <= 2
    finally:
        kafka.close()
        broker.kill()
        h.close()
