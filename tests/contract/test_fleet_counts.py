"""Contract: the fleet gauges read the same from every store."""

from __future__ import annotations

from agentdispatch import Submission
from agentdispatch.metrics import FleetCollector
from agentdispatch.workitem import Outcome


def _gauges(collector: FleetCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def test_fleet_gauges_count_each_tenant(harness):
    d = harness.dispatcher()
    acme = [d.submit(Submission(kind="echo", tenant="acme")).job_id for _ in range(3)]
    d.submit(Submission(kind="echo", tenant="globex"))
    held = harness.store.claim(acme[0], "acme", owner="w:1", ttl_s=30)
    dead = harness.store.claim(acme[1], "acme", owner="w:1", ttl_s=30)
    assert held.lease is not None and dead.lease is not None
    harness.store.commit(dead.lease, Outcome(ok=False, error="x", dead_letter_reason="operator"))

    now = harness.store.get(acme[1], "acme").completed_at + 5.0
    every = _gauges(FleetCollector(lambda: (harness.store, harness.transport), clock=lambda: now))
    assert every[("agent_utilities_dispatch_store_up", ())] == 1
    assert every[("agent_utilities_dispatch_tenant_depth", (("tenant", "acme"),))] == 1
    assert every[("agent_utilities_dispatch_tenant_depth", (("tenant", "globex"),))] == 1
    assert every[("agent_utilities_dispatch_turns_in_flight", (("tenant", "acme"),))] == 1
    assert every[("agent_utilities_dispatch_dead_letter", (("tenant", "acme"),))] == 1
    assert every[("agent_utilities_dispatch_dead_letter", (("tenant", "globex"),))] == 0
    assert every[("agent_utilities_dispatch_dead_letter_oldest_age_seconds", (("tenant", "acme"),))] == 5.0

    mine = _gauges(FleetCollector(lambda: (harness.store, harness.transport), tenant="globex"))
    assert {dict(k[1]).get("tenant") for k in mine if k[0].endswith("_dead_letter")} == {"globex"}


def test_an_unreadable_store_is_store_up_zero_not_a_failed_scrape(harness):
    def broken():
        raise OSError("the store is gone")

    gauges = _gauges(FleetCollector(broken))
    assert gauges == {("agent_utilities_dispatch_store_up", ()): 0}
