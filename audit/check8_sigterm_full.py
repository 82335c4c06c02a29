"""Audit: SIGTERM to a worker while its disk is full (turns in flight, and
idle): it must still exit (0 or non-zero, but exit) within its grace period
plus a little, not hang; the turns stay accepted."""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from backends import sqlite_harness  # noqa: E402
from diskkit import fill, small_disk, spawn_worker, until  # noqa: E402
from ports import free_port  # noqa: E402

from agentdispatch import Submission  # noqa: E402

for busy, late in ((True, False), (False, False), (False, True)):
    tmp = Path(tempfile.mkdtemp(prefix="audit8-"))
    with small_disk(tmp / "disk", size="8m") as disk:
        h = sqlite_harness(disk)
        try:
            kind = "sleep" if busy else "echo"
            payload = {"seconds": 3} if busy else {}
            subs = [Submission(kind=kind, tenant="t", payload=payload) for _ in range(20)]
            handles = h.dispatcher().submit_many(subs)
            log = tmp / "w.log"
            if late:  # the worker starts on a disk that is already full
                filler = fill(disk)
            w = spawn_worker(h.env, log, free_port(), ("--concurrency", "8"))
            if busy:
                until(lambda: sum(h.store.get(x.job_id, "t").status.value == "running" for x in handles) >= 8,
                      "turns never ran", 30)  # fmt: skip
            elif late:
                until(lambda: "disk is full" in log.read_text(), "the worker never met the full disk", 30)
            else:
                until(lambda: all(h.store.get(x.job_id, "t").status.value == "succeeded" for x in handles),
                      "turns never finished", 30)  # fmt: skip
            if not late:
                filler = fill(disk)
            time.sleep(2)
            t0 = time.monotonic()
            w.send_signal(signal.SIGTERM)
            try:
                code = w.wait(timeout=60)
                print(f"busy={busy} late={late}: exit {code} {time.monotonic() - t0:.1f}s after SIGTERM (grace 5 s)")
            except Exception:
                print(f"busy={busy} late={late}: still running 60 s after SIGTERM (grace 5 s)")
                w.kill()
                w.wait()
            print("   log tail:", log.read_text().splitlines()[-3:])
            filler.unlink()
        finally:
            h.close()
