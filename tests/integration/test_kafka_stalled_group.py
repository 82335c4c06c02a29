"""A consumer group that delivers nothing for good, against a real broker
(Tansu) and a real worker process: the ready turns still run.

After a broker restart Tansu can leave the group answering every rejoin with
an empty assignment, so that the stall watch's rejoins change nothing and the
turns stay ready until the workers are restarted. The test builds the same
state on purpose: a foreign member that joined first holds the only partition
(it is the group's leader and sorts first) and consumes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).parents[1]))

from agentdispatch import Status, Submission
from agentdispatch.dispatch import Dispatcher
from agentdispatch.factory import open_backends
from agentdispatch.settings import KAFKA_GROUP, KAFKA_TOPIC, load_settings
from kafka_broker import Broker


class Hog:
    """A member of the agentdispatch group that holds its partitions and never
    takes a message (paused), polling only to stay in the group."""

    def __init__(self, bootstrap: str) -> None:
        self.assigned: list[int] = []
        self._stop = threading.Event()
        # Member ids start with the client id: "a-hog" sorts before
        # "agentdispatch", so the range assignor gives this member partition 0.
        self._c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": KAFKA_GROUP,
                "client.id": "a-hog",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
            }
        )
        self._c.subscribe([KAFKA_TOPIC], on_assign=self._on_assign)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self.assigned = [p.partition for p in parts]
        if parts:
            # Assigned here rather than after the callback, so that the pause
            # holds from the start.
            consumer.assign(parts)
            consumer.pause(parts)

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._c.poll(0.2)
            assert msg is None or msg.error() is not None, "the hog was handed a message"

    def start(self, timeout_s: float = 20.0) -> Hog:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.assigned != [0]:
            assert time.monotonic() < deadline, "the hog never got the partition"
            time.sleep(0.05)
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._c.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.kill()


@pytest.mark.slow
def test_turns_run_while_the_group_delivers_nothing_across_rejoins(tmp_path: Path, broker: Broker) -> None:
    env = {
        **os.environ,
        "TASK_QUEUE_BACKEND": "kafka",
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AGENT_TURNS_PARTITIONS": "1",
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"),
        "AGENT_DISPATCH_CLAIM_TTL_S": "4",
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "1",
    }
    env.pop("STATE_DB_URI", None)
    settings = load_settings(
        task_queue_backend="kafka",
        kafka_bootstrap_servers=broker.bootstrap,
        agent_turns_partitions=1,
        data_dir=tmp_path / "data",
        state_db_uri=None,
    )
    store, transport = open_backends(settings)  # creates the topic
    hog = Hog(broker.bootstrap).start()
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "20"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        subs = [Submission(kind="echo", tenant="t", session_id=f"s{i % 3}", payload={"i": i}) for i in range(9)]
        jobs = [h.job_id for h in Dispatcher(store, transport, settings).submit_many(subs)]
        deadline = time.monotonic() + 90
        while not all(store.get(j, None).status is Status.SUCCEEDED for j in jobs):
            assert worker.poll() is None, f"the worker exited: {(tmp_path / 'worker.log').read_text()[-2000:]}"
            statuses = [store.get(j, None).status.value for j in jobs]
            assert time.monotonic() < deadline, f"turns left while the group delivered nothing: {statuses}"
            time.sleep(0.5)
        # The group never delivered to the worker: the turns ran from the store.
        assert hog.assigned == [0]
        assert "rejoining the group" in (tmp_path / "worker.log").read_text()
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
        hog.close()
        transport.close()
        store.close()
