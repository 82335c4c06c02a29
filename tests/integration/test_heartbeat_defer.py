"""A turn claimed right after a heartbeat shows in the fleet view within a
second or so: the beat it asks for is deferred, not dropped (the periodic
beat here comes only every 30 s)."""

from __future__ import annotations

import threading
from pathlib import Path

from agentdispatch import Registry, Submission
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.worker import Worker, WorkerOptions
from backends import sqlite_harness


def _shows(harness, session: str, timeout: float) -> bool:
    seen = threading.Event()

    def poll() -> None:
        while not seen.wait(0.05):
            if any(session in w.active_sessions for w in harness.store.workers()):
                seen.set()

    threading.Thread(target=poll, daemon=True).start()
    return seen.wait(timeout)


def _registry(release: threading.Event) -> Registry:
    reg = Registry()

    @reg.register("hold")
    def hold(turn, guard):
        release.wait(30)
        return {}

    return reg


def test_async_worker_shows_a_turn_claimed_after_its_first_beat(tmp_path: Path) -> None:
    harness = sqlite_harness(tmp_path)
    release = threading.Event()
    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=30.0, grace_s=5.0)
    worker = AsyncWorker(harness.settings, harness.store, harness.transport, _registry(release), options=opts)
    harness.dispatcher().submit(Submission(kind="hold", payload={}, session_id="chat-1"))
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        # Long before the next periodic beat (30 s): only the deferred beat can show it.
        assert _shows(harness, "chat-1", timeout=10), "the claimed session never reached the heartbeat row"
    finally:
        release.set()
        worker.request_stop()
        thread.join(timeout=60)
        harness.close()


def test_thread_worker_defers_a_beat_inside_the_one_second_window(tmp_path: Path) -> None:
    harness = sqlite_harness(tmp_path)
    release = threading.Event()
    worker = Worker(
        harness.settings,
        harness.store,
        harness.transport,
        _registry(release),
        options=WorkerOptions(heartbeat_s=30.0, get_wait_s=0.05),
    )
    worker.start()  # beats at once; the claim below lands inside the next second
    try:
        harness.dispatcher().submit(Submission(kind="hold", payload={}, session_id="chat-2"))
        assert _shows(harness, "chat-2", timeout=10), "the claimed session never reached the heartbeat row"
    finally:
        release.set()
        worker.stop()
        harness.close()
