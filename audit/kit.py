"""What the audit scripts share: a clean environment for CLI processes and a
gateway process started on a free port, returned once it answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from ports import free_port


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without the project's settings, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))}
    env.update(settings)
    return env


def start_gateway(env: dict[str, str], log: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """``agentdispatch gateway ARGS`` on a free port, logging to ``log``; its
    process and port once ``/healthz`` answers."""
    port = free_port()
    with log.open("wb") as out:
        gw = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "gateway", "--port", str(port), *args],
            env=env,
            stdout=out,
            stderr=out,
        )
    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.1)
    return gw, port
