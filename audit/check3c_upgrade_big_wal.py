"""Audit 3c: a WAL that already filled a small disk (made by the base code,
BASE_SRC) is recovered by this branch's worker once a filler is deleted."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

root = Path(tempfile.mkdtemp(prefix="audit3c-"))
disk = root / "disk"
disk.mkdir()
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(disk)], check=True)
here = Path(__file__).resolve().parent.parent
try:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))}
    env.update(AGENT_DISPATCH_DATA_DIR=str(disk / "data"), TASK_QUEUE_BACKEND="sqlite",
               AGENT_DISPATCH_CLAIM_TTL_S="5", AGENT_DISPATCH_RENEW_INTERVAL_S="1")  # fmt: skip
    base = {**env, "PYTHONPATH": f"{os.environ['BASE_SRC']}:{here / 'tests'}"}
    new = {**env, "PYTHONPATH": f"{here / 'src'}:{here / 'tests'}"}
    (disk / "filler").write_bytes(b"\xff" * (1 << 20))
    sub = ("from agentdispatch import *; s=load_settings(); st,tr=open_backends(s); d=Dispatcher(st,tr,s); "
           "print(len(d.submit_many([Submission(kind='echo', payload={'pad': 'x'*2000}) for _ in range(300)])))")
    print("submitted", subprocess.run([sys.executable, "-c", sub], env=base, capture_output=True, text=True).stdout.strip())
    log = (root / "base-worker.log").open("wb")
    w = subprocess.Popen([sys.executable, "-m", "agentdispatch", "worker", "--grace", "2"], env=base, stdout=log, stderr=log)
    time.sleep(15)
    w.terminate()
    w.wait(timeout=30)
    db = sqlite3.connect(disk / "data" / "agent_dispatch_queue.db")
    print("base code after 15 s:", db.execute("SELECT status, count(*) FROM work_items GROUP BY 1").fetchall())
    db.close()
    print("files:", {f.name: f.stat().st_size for f in (disk / "data").iterdir()},
          "free KB", os.statvfs(disk).f_bavail * 4)  # fmt: skip
    log = (root / "new-worker.log").open("wb")
    w = subprocess.Popen([sys.executable, "-m", "agentdispatch", "worker", "--grace", "2"], env=new, stdout=log, stderr=log)
    time.sleep(3)
    (disk / "filler").unlink()
    t0 = time.time()
    while time.time() - t0 < 60:
        db = sqlite3.connect(disk / "data" / "agent_dispatch_queue.db")
        rows = dict(db.execute("SELECT status, count(*) FROM work_items GROUP BY 1").fetchall())
        db.close()
        if rows.get("succeeded") == 300:
            break
        time.sleep(1)
    print(f"this branch, {time.time() - t0:.0f}s after the filler was deleted:", rows)
    print("files:", {f.name: f.stat().st_size for f in (disk / "data").iterdir()})
    w.terminate()
    print("worker exit", w.wait(timeout=30))
finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)
