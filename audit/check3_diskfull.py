"""Audit 3: the SQLite data dir on a small tmpfs; submit through the CLI and the
gateway's HTTP API until the disk is full while a worker runs; check the answers,
then free a filler file and check that every accepted turn finishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from kit import clean_env, start_gateway

SIZE = os.environ.get("DISK", "4m")
FILLER_MB = int(os.environ.get("FILLER_MB", "1"))
root = Path(tempfile.mkdtemp(prefix="audit3-"))
disk = root / "disk"
disk.mkdir()
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(disk)], check=True)
procs: list[subprocess.Popen[bytes]] = []
try:
    data = disk / "data"
    env = clean_env(AGENT_DISPATCH_DATA_DIR=str(data), TASK_QUEUE_BACKEND="sqlite",
               AGENT_DISPATCH_CLAIM_TTL_S="5", AGENT_DISPATCH_RENEW_INTERVAL_S="1")  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentdispatch", *args], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    assert cli("migrate").returncode == 0
    token = json.loads(cli("token", "create", "--tenant", "default", "--json").stdout)["token"]
    filler = disk / "filler"
    filler.write_bytes(b"\xff" * (FILLER_MB << 20))
    wlog = (root / "worker.log").open("wb")
    gw, port = start_gateway(env, root / "gateway.log")
    procs.append(gw)
    worker = subprocess.Popen([sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "8", "--grace", "5"],
                              env=env, stdout=wlog, stderr=wlog)  # fmt: skip
    procs.append(worker)
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    accepted: list[str] = []
    refusals: Counter[str] = Counter()
    samples: dict[str, str] = {}
    pad = "x" * 3000
    fails_in_a_row = 0
    n = 0
    t0 = time.time()
    while fails_in_a_row < 12 and time.time() - t0 < 300:
        n += 1
        # Mostly HTTP (cheap), a CLI submission every 10th.
        if n % 10 == 0:
            p = cli("submit", "sleep", "--payload", json.dumps({"seconds": 0.2, "pad": pad}), "--json")
            if p.returncode == 0:
                accepted.append(json.loads(p.stdout)["job_id"])
                fails_in_a_row = 0
            else:
                key = f"cli rc={p.returncode}"
                refusals[key] += 1
                samples.setdefault(key, (p.stdout + p.stderr).strip()[-400:])
                fails_in_a_row += 1
        else:
            r = c.post("/v1/jobs", json={"kind": "sleep", "payload": {"seconds": 0.2, "pad": pad}})
            if r.status_code in (200, 201, 202):
                accepted.append(r.json()["job_id"])
                fails_in_a_row = 0
            else:
                key = f"http {r.status_code}"
                refusals[key] += 1
                samples.setdefault(key, f"{r.text[:300]} retry-after={r.headers.get('retry-after')}")
                fails_in_a_row += 1
    print(
        f"accepted {len(accepted)}, refusals {dict(refusals)}; df: {subprocess.run(['df', '-k', str(disk)], capture_output=True, text=True).stdout.splitlines()[-1]}"
    )
    for k, v in samples.items():
        print(f"  {k}: {v}")
    time.sleep(3)
    print("worker alive while full:", worker.poll() is None, "gateway alive:", gw.poll() is None)
    st = cli("status", accepted[-1])
    print("CLI status while full rc", st.returncode, (st.stdout + st.stderr).strip()[-200:])
    filler.unlink()
    print("filler removed; free KB", os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize // 1024)
    # After space comes back: more submissions go through, and everything finishes.
    more = []
    for i in range(20):
        r = c.post("/v1/jobs", json={"kind": "echo", "payload": {"after": i}})
        more.append(r.status_code)
        if r.status_code in (200, 201, 202):
            accepted.append(r.json()["job_id"])
    p = cli("submit", "echo", "--payload", '{"after": "cli"}', "--json")
    print("after freeing: http", Counter(more), "cli rc", p.returncode, p.stderr.strip()[-200:])
    if p.returncode == 0:
        accepted.append(json.loads(p.stdout)["job_id"])
    deadline = time.time() + float(os.environ.get("DRAIN_S", "90"))
    while True:
        statuses = Counter()
        for j in accepted:
            r = c.get(f"/v1/jobs/{j}")
            statuses[r.json().get("status") if r.status_code == 200 else f"http {r.status_code}"] += 1
        if statuses.get("succeeded", 0) == len(accepted) or time.time() > deadline:
            break
        time.sleep(2)
    print(f"after {time.time() - t0:.0f}s: {dict(statuses)} of {len(accepted)}; worker alive {worker.poll() is None}")
    print("df:", subprocess.run(["df", "-k", str(disk)], capture_output=True, text=True).stdout.splitlines()[-1])
    print("files:", {f.name: f.stat().st_size for f in data.iterdir()})
    integ = subprocess.run(["sqlite3", str(data / "agent_dispatch_queue.db"), "PRAGMA integrity_check"],
                           capture_output=True, text=True)  # fmt: skip
    print("integrity:", integ.stdout.strip() or integ.stderr.strip())
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            print("exit", p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            p.kill()
    subprocess.run(["umount", "-l", str(disk)], check=False)
    for name in ("worker.log", "gateway.log"):
        text = (root / name).read_text()
        print(f"--- {name} ({len(text.splitlines())} lines), tail:")
        print("\n".join(text.splitlines()[-15:]))
    print("root", root)
