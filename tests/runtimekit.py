"""Real `agentdispatch worker` processes running ``apps/runtime_app.py``, and
what its handlers wrote to the sink (one log file per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def runtime_worker(env: dict[str, str], *extra: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """``agentdispatch worker --concurrency 50`` on the runtime app, with ``env``."""
    full = {**os.environ, **env, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "50", "--app", "runtime_app:registry"]
    return subprocess.Popen([*cmd, *extra], env=full, stdout=subprocess.DEVNULL, stderr=stderr)


def sink_lines(sink: Path, word: str) -> list[str]:
    """The job ids of the sink's lines that start with ``word`` (start, effect)."""
    return [ln.split()[1] for f in sink.glob("*.log") for ln in f.read_text().splitlines() if ln.startswith(word)]
