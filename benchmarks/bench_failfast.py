"""How soon the fail-fast paths give up, as a ratio of their configured limit.

The tests assert only the behaviour (an error naming the setting, a 408); the
time it takes lives here:

- a Kafka transport whose broker is unreachable fails start-up (``timeout_s``);
- the intake gateway cuts off a sender that stalls mid-body
  (``AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S``).

    python benchmarks/bench_failfast.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from intake.kit import TG_BOT, gateway, install_all
from ports import free_port

KAFKA_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0


def kafka_start_up(data: Path) -> float:
    from agentdispatch.backends.kafka.transport import KafkaTransport
    from agentdispatch.errors import TaskQueueUnavailable
    from agentdispatch.settings import load_settings

    env = {
        "TASK_QUEUE_BACKEND": "kafka",
        "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "AGENT_DISPATCH_DATA_DIR": str(data),
    }
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        settings = load_settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    t0 = time.perf_counter()
    try:
        KafkaTransport(settings, timeout_s=KAFKA_TIMEOUT_S)
    except TaskQueueUnavailable:
        return time.perf_counter() - t0
    raise AssertionError("an unreachable broker was accepted")


def stalled_body(port: int) -> float:
    head = f"POST /intake/telegram/{TG_BOT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        answer = s.recv(64)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    return time.perf_counter() - t0


def report(name: str, limit_s: float, run: Callable[[], float], repeat: int) -> None:
    times = [run() for _ in range(repeat)]
    worst = max(times)
    print(f"{name:<36} limit {limit_s:4.1f} s  median {statistics.median(times):6.2f} s  "
          f"worst {worst:6.2f} s  worst/limit {worst / limit_s:5.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        report("kafka start-up, broker unreachable", KAFKA_TIMEOUT_S, lambda: kafka_start_up(data), args.repeat)
        install_all(data)
        gw = gateway(data, AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S))
        try:
            report("intake cut-off, body stalls", BODY_TIMEOUT_S, lambda: stalled_body(gw.port), args.repeat)
        finally:
            gw.stop()


if __name__ == "__main__":
    main()
