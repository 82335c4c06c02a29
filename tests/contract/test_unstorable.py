"""Contract: what a handler hands back that JSON cannot hold (a NaN, a value
nested too deeply, an exception whose message cannot be read) still ends its
turn with a reason, and every view of the job stays standard JSON."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentdispatch import InvalidInput, NonRetryableError, Registry, Status, Submission
from agentdispatch.runtime import AsyncWorker, RuntimeOptions

from .helpers import wait_until

FAST = {"claim_ttl_s": 3.0, "renew_interval_s": 0.3, "max_attempts": 1}


@contextmanager
def running(harness: Any, registry: Registry) -> Iterator[AsyncWorker]:
    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=1.0, grace_s=5.0)
    worker = AsyncWorker(harness.settings, harness.store, harness.transport, registry, options=opts)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the worker did not stop"
    assert worker.fatal is None, worker.fatal


def _nested(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this message cannot be read")


def _registry() -> Registry:
    reg = Registry()

    @reg.register("not_a_number")
    def not_a_number(turn, guard):
        return {"score": float("nan"), "limit": float("inf")}

    @reg.register("too_deep")
    def too_deep(turn, guard):
        return _nested(5000)

    @reg.register("effect_not_a_number")
    def effect_not_a_number(turn, guard):
        return guard.side_effect(f"score:{turn.job_id}", lambda: float("-inf"))

    @reg.register("unprintable")
    def unprintable(turn, guard):
        raise _Unprintable()

    @reg.register("nul_message")
    def nul_message(turn, guard):
        # Bytes decoded loosely: a NUL and a lone surrogate neither database takes as text.
        raise RuntimeError("reply was b'\\x00' \x00 and \ud800")

    @reg.register("nul_non_retryable")
    def nul_non_retryable(turn, guard):
        raise NonRetryableError("refused \x00 here", reason="bad\x00input")

    @reg.register("deep_checkpoint")
    def deep_checkpoint(turn, guard):
        try:
            guard.checkpoint(_nested(5000))
        except InvalidInput as exc:
            return {"refused": str(exc)}
        return {"refused": None}

    return reg


def _run(make_harness: Any, kinds: list[str]) -> dict[str, dict[str, Any]]:
    harness = make_harness(**FAST)
    d = harness.dispatcher()
    jobs = {k: d.submit(Submission(kind=k, tenant="t")).job_id for k in kinds}
    with running(harness, _registry()):
        # Well within one lease TTL: none of them may wait out its lease.
        wait_until(lambda: all(harness.store.get(j, "t").status.terminal for j in jobs.values()), timeout=30)
    views = {k: d.history(j, "t") for k, j in jobs.items()}
    for view in views.values():
        json.dumps(view, allow_nan=False)  # what the gateway answers with: standard JSON
    return views


def test_results_json_cannot_hold_are_stored_as_text_and_views_stay_json(make_harness):
    views = _run(make_harness, ["not_a_number", "too_deep", "effect_not_a_number", "deep_checkpoint"])
    assert {v["job"]["status"] for v in views.values()} == {Status.SUCCEEDED.value}
    assert "nested too deeply" in views["too_deep"]["job"]["result"]
    assert [e["state"] for e in views["effect_not_a_number"]["side_effects"]] == ["committed"]
    assert "nests too deeply" in views["deep_checkpoint"]["job"]["result"]["refused"]


def test_an_exception_whose_message_cannot_be_read_still_ends_the_turn(make_harness):
    failed = _run(make_harness, ["unprintable"])["unprintable"]["job"]
    assert failed["status"] == Status.DEAD_LETTER.value and failed["reason"] == "max_attempts"
    assert failed["error"].startswith("_Unprintable: ")


def test_an_exception_message_no_database_can_store_still_ends_the_turn(make_harness):
    views = _run(make_harness, ["nul_message", "nul_non_retryable", "not_a_number"])
    failed = views["nul_message"]["job"]
    assert failed["status"] == Status.DEAD_LETTER.value and failed["reason"] == "max_attempts"
    assert failed["error"].startswith("RuntimeError: reply was")
    assert "\x00" not in failed["error"] and "\ud800" not in failed["error"]
    refused = views["nul_non_retryable"]["job"]
    assert refused["status"] == Status.FAILED.value and "\x00" not in refused["error"] + refused["reason"]
    # A turn committed beside them is not held back by their outcomes.
    assert views["not_a_number"]["job"]["status"] == Status.SUCCEEDED.value
