"""A real ``agentdispatch gateway`` subprocess on a free loopback port, on a
SQLite store in a temporary data dir, plus helpers to mint tokens through
the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def cli_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess on ``data_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))}
    env.update(AGENT_DISPATCH_DATA_DIR=str(data_dir), TASK_QUEUE_BACKEND="sqlite")
    env.update(extra)  # extra wins (e.g. a PostgreSQL store)
    return env


def cli(data_dir: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``agentdispatch ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "agentdispatch", *args],
        env=cli_env(data_dir, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


@dataclass
class Gateway:
    """A running gateway subprocess."""

    data_dir: Path
    port: int
    proc: subprocess.Popen[str]
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self, tenant: str) -> str:
        """A bearer token for ``tenant`` (minted once per tenant via the CLI)."""
        if tenant not in self.tokens:
            self.tokens[tenant] = self.mint(tenant)["token"]
        return self.tokens[tenant]

    def mint(self, tenant: str) -> dict[str, Any]:
        """``agentdispatch token create --tenant T --json``."""
        out = cli(self.data_dir, "token", "create", "--tenant", tenant, "--json")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def client(self, tenant: str | None = None, **kw: Any) -> httpx.Client:
        """A keep-alive client, authenticated as ``tenant`` when given."""
        headers = {"Authorization": f"Bearer {self.token(tenant)}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10, **kw)

    def log(self) -> str:
        """What the gateway wrote to stderr."""
        return (self.data_dir / "gateway.log").read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on loopback ``port`` (Linux)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:  # closed since it was listed
            continue
    return False


def start_gateway(data_dir: Path, *args: str, **env: str) -> Gateway:
    """Start ``agentdispatch gateway`` on a port the system picks (``--port 0``)
    and wait until /healthz answers from it. The gateway prints the URL it
    bound before it serves: no other process can hold that port meanwhile."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = (data_dir / "gateway.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "gateway", "--host", "127.0.0.1", "--port", "0", *args],
        env=cli_env(data_dir, **env),
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    log.close()
    gw = Gateway(data_dir, 0, proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {gw.log()}")
        if not gw.port:
            bound = re.search(r"gateway on .*: http://127\.0\.0\.1:(\d+)/", gw.log())
            gw.port = int(bound.group(1)) if bound else 0
        try:
            if gw.port and httpx.get(f"{gw.url}/healthz", timeout=1).status_code == 200:
                assert listens(proc.pid, gw.port)
                return gw
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    gw.stop()
    raise RuntimeError("gateway did not start within 30 s")
