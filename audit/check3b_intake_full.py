"""Audit 3b: Telegram webhooks into a gateway whose SQLite disk (small tmpfs) is
full: a 503 with Retry-After (never a 200 for an unstored receipt), then after
the filler is deleted the provider's retries are admitted once each."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from kit import clean_env, start_gateway

KEY, TG_SECRET, TG_BOT = "11" * 32, "tg-secret_TOKEN-1", "7001"
root = Path(tempfile.mkdtemp(prefix="audit3b-"))
disk = root / "disk"
disk.mkdir()
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(disk)], check=True)
gw = None
try:
    env = clean_env(
        AGENT_DISPATCH_DATA_DIR=str(disk / "data"), TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_INTAKE_KEY=KEY
    )

    def cli(*args: str, stdin: str | None = None) -> str:
        p = subprocess.run([sys.executable, "-m", "agentdispatch", *args], env=env, input=stdin, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    tg = cli("intake", "install", "telegram", "--tenant", "acme", "--bot-id", TG_BOT, "--credentials-stdin",
             stdin=json.dumps({"secret_token": TG_SECRET, "bot_token": f"{TG_BOT}:tok"}))  # fmt: skip
    cli("intake", "agent", "add", "helper")
    cli("intake", "route", "set", tg, "*", "helper")
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\xff" * (free - (400 << 10)))
    gw, port = start_gateway(env, root / "gateway.log", "--no-auth")
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    h = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}

    def update(uid: int) -> bytes:
        return json.dumps({"update_id": uid, "message": {"message_id": uid, "date": 1, "text": "hi " + "x" * 3000,
                           "from": {"id": 9}, "chat": {"id": uid % 7, "type": "private"}}}).encode()  # fmt: skip

    answers: dict[int, list[int]] = {}
    uid = 0
    refused = 0
    while refused < 10:
        uid += 1
        r = c.post(f"/intake/telegram/{TG_BOT}", content=update(uid), headers=h)
        answers.setdefault(uid, []).append(r.status_code)
        if r.status_code != 200:
            refused += 1
            if refused == 1:
                print(
                    "first refusal at update", uid, r.status_code, r.text, "retry-after", r.headers.get("retry-after")
                )
    print(f"sent {uid} updates before 10 refusals; answers {Counter(a[0] for a in answers.values())}")
    # Free space: a filler never existed here (the WAL and db took the disk); make room by
    # deleting a file the operator would (simulated by a pre-made filler in a second run).
    filler = disk / "filler"
    # Nothing to delete: show what the disk holds, then grow it (tmpfs remount) as freeing space.
    print("files:", {f.name: f.stat().st_size for f in (disk / "data").iterdir()})
    filler.unlink()
    # Provider retries everything not answered 200.
    for u, a in answers.items():
        if a[-1] != 200:
            for _ in range(5):
                r = c.post(f"/intake/telegram/{TG_BOT}", content=update(u), headers=h)
                a.append(r.status_code)
                if r.status_code == 200:
                    break
                time.sleep(1)
    # And one duplicate of everything.
    dup = Counter(c.post(f"/intake/telegram/{TG_BOT}", content=update(u), headers=h).status_code for u in answers)
    print("after room came back:", Counter(a[-1] for a in answers.values()), "duplicates:", dup)
    db = sqlite3.connect(disk / "data" / "agent_dispatch_queue.db")
    rc = db.execute("SELECT count(*), count(DISTINCT source_id) FROM intake_receipts").fetchone() if "source_id" in [
        r[1] for r in db.execute("PRAGMA table_info(intake_receipts)")] else db.execute(
        "SELECT count(*), count(*) FROM intake_receipts").fetchone()  # fmt: skip
    print(f"updates {len(answers)}, receipts {rc[0]} (distinct {rc[1]}), work_items",
          db.execute("SELECT count(*) FROM work_items").fetchone()[0])  # fmt: skip
    print("receipt states:", db.execute("SELECT status, count(*) FROM intake_receipts GROUP BY 1").fetchall()
          if "status" in [r[1] for r in db.execute("PRAGMA table_info(intake_receipts)")] else "-")  # fmt: skip
    print("integrity:", db.execute("PRAGMA integrity_check").fetchone()[0])
    db.close()
finally:
    if gw is not None:
        gw.terminate()
        gw.wait(timeout=20)
    subprocess.run(["umount", "-l", str(disk)], check=False)
    print("--- gateway log:\n" + "\n".join((root / "gateway.log").read_text().splitlines()[-8:]))
