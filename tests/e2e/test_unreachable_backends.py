"""An explicitly chosen backend that cannot be reached stops the worker with
exit code 2 and one clear line that echoes no endpoint and no credential."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"TASK_QUEUE_BACKEND": "kafka", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}, "KAFKA_BOOTSTRAP_SERVERS"),
        ({"STATE_DB_URI": f"postgresql://admin:{SECRET}@127.0.0.1:1/nowhere?connect_timeout=1"}, "STATE_DB_URI"),
    ],
    ids=["kafka", "postgres"],
)
def test_worker_preflight_fails_loudly_without_echoing_endpoints(
    tmp_path: Path, env: dict[str, str], names: str
) -> None:
    full = {**os.environ, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "XDG_DATA_HOME": str(tmp_path), **env}
    proc = subprocess.run(
        ["agent-dispatch-worker", "--workers", "1"], env=full, capture_output=True, text=True, timeout=120, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert names in out
    assert "Traceback" not in out
    assert "127.0.0.1:1" not in out and SECRET not in out and "admin" not in out
