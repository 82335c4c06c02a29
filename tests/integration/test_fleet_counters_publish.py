"""Both workers publish their turn counts in their heartbeat row within a
second or so of the turns ending (the periodic beat here comes only every
30 s), and a clean stop leaves exactly the worker's final counts in the
fleet's (the gateway's ``scope="fleet"`` series) with the row gone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from agentdispatch import Registry, Submission
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.worker import Worker, WorkerOptions
from backends import Harness, sqlite_harness


def _registry(release: threading.Event) -> Registry:
    reg = Registry()

    @reg.register("ok")
    def ok(turn, guard):
        release.wait(30)
        return {}

    @reg.register("boom")
    def boom(turn, guard):
        release.wait(30)
        raise RuntimeError("the model provider is down")

    return reg


def _until(check: Callable[[], bool], timeout: float) -> bool:
    seen = threading.Event()

    def poll() -> None:
        while not seen.wait(0.05):
            if check():
                seen.set()

    threading.Thread(target=poll, daemon=True).start()
    return seen.wait(timeout)


SESSIONS = ("ok-0", "ok-1", "ok-2", "boom")
EXPECTED = {"turns_total:completed": 3, "turns_total:dead_letter": 1, "time_in_queue_seconds_count": 4}


def _run(harness: Harness, release: threading.Event, stop: Callable[[], object], worker: AsyncWorker | Worker) -> None:
    d = harness.dispatcher()
    for session in SESSIONS:
        d.submit(Submission(kind=session.partition("-")[0], payload={}, session_id=session))
    # Every turn running, its claim's beat written: the turns end after it.
    running = _until(lambda: [set(w.active_sessions) for w in harness.store.workers()] == [set(SESSIONS)], 10)
    assert running, harness.store.workers()
    assert harness.store.fleet_counters().get("turns_total:completed") is None
    release.set()
    # Long before the next periodic beat (30 s): only the beat after the commits can show them.
    published = _until(lambda: all(harness.store.fleet_counters().get(k) == v for k, v in EXPECTED.items()), 10)
    assert published, harness.store.fleet_counters()
    assert [w.counters.get("turns_total:completed") for w in harness.store.workers()] == [3]
    # One more turn, ended and stopped at once: its beat is likely still
    # deferred, and the stop's final counts still count it.
    last = d.submit(Submission(kind="ok", payload={}, session_id="last")).job_id
    assert _until(lambda: harness.store.get(last, None).status.terminal, 10)
    stop()
    assert harness.store.workers() == []
    final = worker.metrics.published()
    assert (final["turns_total:completed"], final["attempts_count"]) == (4, 5)
    assert harness.store.fleet_counters() == final


def test_async_worker_publishes_its_counts_and_leaves_them_at_stop(tmp_path: Path) -> None:
    harness = sqlite_harness(tmp_path, max_attempts=1)
    release = threading.Event()
    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=30.0, grace_s=5.0)
    worker = AsyncWorker(harness.settings, harness.store, harness.transport, _registry(release), options=opts)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        worker.request_stop()
        thread.join(timeout=60)
        assert not thread.is_alive()

    try:
        _run(harness, release, stop, worker)
    finally:
        release.set()
        stop()
        harness.close()


def test_thread_worker_publishes_its_counts_and_leaves_them_at_stop(tmp_path: Path) -> None:
    harness = sqlite_harness(tmp_path, max_attempts=1)
    release = threading.Event()
    opts = WorkerOptions(threads=4, heartbeat_s=30.0, get_wait_s=0.05)
    worker = Worker(harness.settings, harness.store, harness.transport, _registry(release), options=opts)
    worker.start()
    try:
        _run(harness, release, worker.stop, worker)
        # A beat asked for after the stop (a claim thread past its grace) writes no row again.
        worker._beat(force=True)
        assert harness.store.workers() == []
    finally:
        release.set()
        worker.stop()
        harness.close()
