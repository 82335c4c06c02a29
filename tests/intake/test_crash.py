"""Crash around the 200: the gateway is SIGKILLed at random points while a
sender keeps retrying; every source identity ends with exactly one receipt and
one WorkItem, and no 200 was ever answered without its committed row."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from e2e.gatewayproc import Gateway
from intake.kit import count, gateway, install_all, post_tg, tg_update

UPDATES = 120
MAX_KILLS = 8


@pytest.mark.slow
def test_sigkill_storm_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    install_all(data)
    current: list[Gateway] = [gateway(data)]
    done = threading.Event()
    acked: list[int] = []
    attempts = [0]

    def sender() -> None:
        rng = random.Random(7)
        for update_id in range(1, UPDATES + 1):
            while True:
                attempts[0] += 1
                try:
                    with httpx.Client(base_url=current[0].url, timeout=5) as c:
                        if post_tg(c, tg_update(update_id, chat=rng.randint(1, 5))).status_code == 200:
                            acked.append(update_id)
                            break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)  # the provider retries
        done.set()

    t = threading.Thread(target=sender)
    t.start()
    rng = random.Random(11)
    kills = 0
    try:
        # Each kill costs a gateway start-up: eight of them, at random points
        # of the run, cover the moments around the 200 without making the test
        # a start-up benchmark.
        while kills < MAX_KILLS and not done.wait(rng.uniform(0.1, 0.5)):
            os.kill(current[0].proc.pid, signal.SIGKILL)
            current[0].proc.wait()
            kills += 1
            current[0] = gateway(data)
    finally:
        done.wait(120)
        t.join(timeout=10)
        current[0].stop()
    assert kills >= 3 and sorted(acked) == list(range(1, UPDATES + 1))
    assert count(data, "SELECT count(*) FROM intake_receipts") == UPDATES
    assert count(data, "SELECT count(DISTINCT source_id) FROM intake_receipts") == UPDATES
    assert count(data, "SELECT count(*) FROM work_items WHERE kind = 'intake_turn'") == UPDATES
    joined = "SELECT count(*) FROM intake_receipts r JOIN work_items w ON w.id = r.job_id"
    assert count(data, joined) == UPDATES
    print(f"kills={kills} deliveries={attempts[0]} for {UPDATES} updates")
