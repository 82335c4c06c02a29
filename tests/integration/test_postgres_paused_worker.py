"""An async worker on PostgreSQL paused (SIGSTOP: a frozen VM, a debugger)
past its lease TTL: a peer runs its turns again, and when it wakes it runs no
side effect and commits nothing of them, says so in its log, and serves on."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from agentdispatch import Status, Submission
from backends import postgres_harness
from contract.helpers import wait_until
from crashkit import pause_between_writes
from runtimekit import runtime_worker

TTL = {"AGENT_DISPATCH_CLAIM_TTL_S": "2", "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5"}


def _lines(log: Path, word: str) -> list[str]:
    """The job ids of ``log``'s lines that start with ``word``."""
    if not log.exists():
        return []
    return [ln.split()[1] for ln in log.read_text().splitlines() if ln.startswith(word)]


def test_a_worker_paused_past_its_ttl_wakes_fenced_and_serves_on(tmp_path: Path) -> None:
    h = postgres_harness(tmp_path, claim_ttl_s=2.0, renew_interval_s=0.5)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, **TTL, "RUNTIME_SINK_DIR": str(sink)}
    d = h.dispatcher()
    workers: list[subprocess.Popen[bytes]] = []
    try:
        jobs = [
            d.submit(Submission(kind="hold", tenant="t", session_id=f"s{i}", payload={"hold_s": 3})).job_id
            for i in range(10)
        ]
        with (tmp_path / "paused.log").open("wb") as err:
            paused = runtime_worker(env, stderr=err.fileno())
        workers.append(paused)
        paused_log = sink / f"{paused.pid}.log"
        wait_until(lambda: sorted(_lines(paused_log, "start")) == sorted(jobs), timeout=60)
        pause_between_writes(paused, None)

        peer = runtime_worker(env)
        workers.append(peer)
        wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=60)
        assert {h.store.get(j, "t").lease_epoch for j in jobs} == {2}
        assert all(h.store.get(j, "t").result == {"pid": peer.pid} for j in jobs)

        # Awake, its handlers' sleeps are over: each turn stops at its guard.
        paused.send_signal(signal.SIGCONT)
        wait_until(lambda: sorted(_lines(paused_log, "end")) == sorted(jobs), timeout=30)
        assert _lines(paused_log, "effect") == []
        assert sorted(_lines(sink / f"{peer.pid}.log", "effect")) == sorted(jobs)  # each effect once
        assert {h.store.get(j, "t").lease_epoch for j in jobs} == {2}
        # An operator reading its log learns why its turns went.
        assert "their turns stop and commit nothing" in (tmp_path / "paused.log").read_text()

        # It serves on: with its peer stopped, it runs the next turn.
        peer.terminate()
        assert peer.wait(timeout=60) == 0
        late = d.submit(Submission(kind="hold", tenant="t", session_id="s0", payload={})).job_id
        wait_until(lambda: h.store.get(late, "t").status is Status.SUCCEEDED, timeout=30)
        assert h.store.get(late, "t").result == {"pid": paused.pid}
        paused.terminate()
        assert paused.wait(timeout=60) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
                w.kill()
                w.wait()
        h.close()
