"""Turns that run 20 times the claim TTL on an async worker with hundreds in
flight (reliability scenario 6): renewals keep every lease, so no turn is
reclaimed and each runs exactly once. Reclaim follows missed renewals only,
never elapsed time."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

from agentdispatch import Status, Submission
from backends import pg_harness_at
from contract.helpers import wait_until
from pg import PrivateCluster
from runtimekit import runtime_worker

TTL_S = 2.0
TURNS = 300


def test_turns_of_twenty_ttls_are_never_reclaimed(tmp_path: Path) -> None:
    cluster = PrivateCluster().start()
    h = pg_harness_at(cluster.uri(), cluster.destroy, claim_ttl_s=TTL_S, renew_interval_s=0.6)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {
        **h.env,
        "AGENT_DISPATCH_CLAIM_TTL_S": str(TTL_S),
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.6",
        "RUNTIME_SINK_DIR": str(sink),
    }
    worker = None
    try:
        d = h.dispatcher()
        jobs = [
            j.job_id
            for j in d.submit_many(
                [
                    Submission(kind="hold", tenant="t", session_id=f"s{i}", payload={"hold_s": 20 * TTL_S})
                    for i in range(TURNS)
                ]
            )
        ]
        with (tmp_path / "worker.log").open("wb") as err:
            worker = runtime_worker(env, "--concurrency", str(TURNS), stderr=err.fileno())
        try:
            wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=300, every=1)
        except AssertionError:
            items = [h.store.get(j, "t") for j in jobs]
            starts = sum(1 for f in sink.glob("*.log") for ln in f.read_text().splitlines() if ln.startswith("start"))
            tail = (tmp_path / "worker.log").read_text()[-3000:]
            states = Counter((i.status.value, i.attempt, i.lease_epoch) for i in items)
            raise AssertionError(f"not all succeeded: {states}; {starts} starts; worker log ends:\n{tail}") from None
        items = [h.store.get(j, "t") for j in jobs]
        assert {(i.attempt, i.lease_epoch) for i in items} == {(1, 1)}
        lines = [ln.split() for f in sink.glob("*.log") for ln in f.read_text().splitlines()]
        assert Counter(ln[1] for ln in lines if ln[0] == "start") == dict.fromkeys(jobs, 1)
        assert Counter(ln[1] for ln in lines if ln[0] == "effect") == dict.fromkeys(jobs, 1)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        log = (tmp_path / "worker.log").read_text()
        assert "not renewed" not in log and "renewal refused" not in log, log
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        h.close()
