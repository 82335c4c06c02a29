"""Audit A13 on SQLite through the gateway: max depth 1,000, 64 concurrent HTTP
producers push 5,000 turns (plus CLI submissions), no worker. Expect exactly
1,000 admitted, every other one an explicit 429, and every admitted one stored."""

from __future__ import annotations

import concurrent.futures as cf
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from kit import clean_env, start_gateway

root = Path(tempfile.mkdtemp(prefix="audit5-"))
env = clean_env(
    AGENT_DISPATCH_DATA_DIR=str(root / "data"), TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_MAX_DEPTH="1000"
)
gw, port = start_gateway(env, root / "gateway.log", "--no-auth")
base = f"http://127.0.0.1:{port}"


def producer(n: int) -> list[tuple[int, str]]:
    out = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for i in range(n):
            r = c.post("/v1/jobs", json={"kind": "echo", "payload": {"i": i}})
            out.append((r.status_code, r.json().get("job_id") or r.json().get("error")))
    return out


def cli_submit(_: int) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "agentdispatch", "submit", "echo", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    return p.returncode, (json.loads(p.stdout)["job_id"] if p.returncode == 0 else p.stderr.strip())


t0 = time.time()
with cf.ThreadPoolExecutor(72) as pool:
    https = [pool.submit(producer, 78) for _ in range(64)]
    clis = [pool.submit(cli_submit, i) for i in range(8)]
    http_out = [x for f in https for x in f.result()]
    cli_out = [f.result() for f in clis]
print(f"{len(http_out)} HTTP + {len(cli_out)} CLI submissions in {time.time() - t0:.1f}s")
print("HTTP answers:", Counter(s for s, _ in http_out), Counter(e for s, e in http_out if s != 202))
print("CLI answers:", Counter(rc for rc, _ in cli_out), {o for rc, o in cli_out if rc != 0})
accepted = [j for s, j in http_out if s == 202] + [o for rc, o in cli_out if rc == 0]
db = sqlite3.connect(root / "data" / "agent_dispatch_queue.db")
stored = {r[0] for r in db.execute("SELECT job_id FROM work_items")} if "job_id" in [
    r[1] for r in db.execute("PRAGMA table_info(work_items)")] else set()  # fmt: skip
print(f"accepted {len(accepted)}, stored work items {db.execute('SELECT count(*) FROM work_items').fetchone()[0]}, "
      f"accepted but not stored {len(set(accepted) - stored) if stored else 'n/a'}")  # fmt: skip
gw.terminate()
gw.wait(timeout=20)
print("gateway log:", (root / "gateway.log").read_text().splitlines()[-5:])
