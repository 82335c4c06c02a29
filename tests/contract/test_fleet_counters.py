"""Contract: the fleet's turn counters (workers' published counts, summed) read
the same from every store and never go down: a worker row's counts go into
the fleet total when the row goes, by a clean stop or a reaper, once."""

from __future__ import annotations

import subprocess
import sys

from agentdispatch import Submission
from agentdispatch.fleet import process_label
from agentdispatch.metrics import FleetCollector, Metrics
from agentdispatch.reconciler import reap_dead_workers
from agentdispatch.stores.base import ClaimKind, WorkerRow

from .helpers import wait_until


def _row(worker_id: str, counters: dict[str, float], process: str = "") -> WorkerRow:
    return WorkerRow(worker_id, "host-x", 4, (), "test", 0.0, process=process, counters=counters)


def _dead_label() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    label = process_label(child.pid)
    child.wait()
    return label


def test_rows_and_removed_rows_add_up_and_never_go_down(harness):
    store = harness.store
    assert store.fleet_counters() == {}
    store.heartbeat(_row("w-a", {"turns_total:completed": 3, "time_in_queue_seconds_sum": 0.5}))
    store.heartbeat(_row("w-b", {"turns_total:completed": 1, "turns_total:failed": 2}))
    assert store.fleet_counters() == {
        "turns_total:completed": 4,
        "turns_total:failed": 2,
        "time_in_queue_seconds_sum": 0.5,
    }
    # A later beat replaces the row's counts (they are cumulative), it does not add to them.
    store.heartbeat(_row("w-a", {"turns_total:completed": 5, "time_in_queue_seconds_sum": 0.75}))
    assert store.fleet_counters()["turns_total:completed"] == 6

    # A clean stop with final counts newer than the last beat: those are kept.
    store.remove_worker("w-a", {"turns_total:completed": 7, "time_in_queue_seconds_sum": 1.0})
    assert store.fleet_counters() == {
        "turns_total:completed": 8,
        "turns_total:failed": 2,
        "time_in_queue_seconds_sum": 1.0,
    }
    # A second removal (a retry, a reaper after the stop) finds no row and adds nothing.
    store.remove_worker("w-a", {"turns_total:completed": 7})
    store.remove_worker("w-b")
    assert store.fleet_counters() == {
        "turns_total:completed": 8,
        "turns_total:failed": 2,
        "time_in_queue_seconds_sum": 1.0,
    }
    assert store.workers() == []


def test_a_reaped_workers_last_counts_stay_in_the_fleet(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t")).job_id
    harness.store.heartbeat(_row("w-dead", {"turns_total:completed": 2, "redeliveries_total": 1}, _dead_label()))
    harness.store.heartbeat(_row("w-live", {"turns_total:completed": 1}, process_label()))
    wait_until(lambda: harness.store.claim(job, "t", owner="w-dead:0", ttl_s=300).kind is ClaimKind.CLAIMED)

    report = reap_dead_workers(harness.store, harness.transport)

    assert report.reclaimed == 1
    assert [w.worker_id for w in harness.store.workers()] == ["w-live"]
    assert harness.store.fleet_counters() == {"turns_total:completed": 3, "redeliveries_total": 1}


def test_the_gateway_families_sum_what_workers_published(harness):
    one, two = Metrics(), Metrics()
    one.turns.labels(outcome="completed").inc(2)
    one.time_in_queue.observe(0.003)
    one.attempts.observe(1)
    two.turns.labels(outcome="poison").inc()
    two.time_in_queue.observe(7)
    two.attempts.observe(3)
    two.redeliveries.inc()
    two.lease_failures.inc(2)
    harness.store.heartbeat(_row("w-1", one.published()))
    harness.store.heartbeat(_row("w-2", two.published()))
    harness.store.remove_worker("w-2", two.published())

    operator = FleetCollector(lambda: (harness.store, harness.transport), counters=True)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in operator.collect() for s in f.samples}
    fleet = (("scope", "fleet"),)
    assert got[("agent_utilities_dispatch_turns_total", (("outcome", "completed"), *fleet))] == 2
    assert got[("agent_utilities_dispatch_turns_total", (("outcome", "poison"), *fleet))] == 1
    assert got[("agent_utilities_dispatch_turns_total", (("outcome", "fenced"), *fleet))] == 0
    assert got[("agent_utilities_dispatch_redeliveries_total", fleet)] == 1
    assert got[("agent_utilities_dispatch_lease_failures_total", fleet)] == 2
    assert got[("agent_utilities_dispatch_time_in_queue_seconds_count", fleet)] == 2
    assert got[("agent_utilities_dispatch_time_in_queue_seconds_sum", fleet)] == 7.003
    assert got[("agent_utilities_dispatch_time_in_queue_seconds_bucket", (("le", "0.005"), *fleet))] == 1
    assert got[("agent_utilities_dispatch_time_in_queue_seconds_bucket", (("le", "10.0"), *fleet))] == 2
    assert got[("agent_utilities_dispatch_attempts_bucket", (("le", "1.0"), *fleet))] == 1
    assert got[("agent_utilities_dispatch_attempts_bucket", (("le", "3.0"), *fleet))] == 2
    assert got[("agent_utilities_dispatch_attempts_sum", fleet)] == 4
    # Without counters=True (a worker's port, a tenant's scrape) none of them.
    plain = FleetCollector(lambda: (harness.store, harness.transport))
    assert not [f for f in plain.collect() if f.name.endswith(("turns", "attempts", "redeliveries"))]
