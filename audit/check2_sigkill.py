"""Audit 2: 4 `agentdispatch worker` processes on one SQLite file, async handlers,
~2,000 turns over 100 sessions submitted through the Python API while a random
worker is SIGKILLed every ~3 s and restarted (under its name). Reports lost,
stuck, duplicate effects, per-session order, and any "locked"/BUSY error text."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
from agentdispatch import Dispatcher, Submission, load_settings, open_backends  # noqa: E402
from crashkit import analyse  # noqa: E402

TURNS, SESSIONS, WORKERS = int(os.environ.get("TURNS", 2000)), 100, 4
root = Path(tempfile.mkdtemp(prefix="audit2-"))
sink = root / "sink"
sink.mkdir()
env = {
    **os.environ,
    "AGENT_DISPATCH_DATA_DIR": str(root / "data"),
    "TASK_QUEUE_BACKEND": "sqlite",
    "AGENT_DISPATCH_CLAIM_TTL_S": "5",
    "AGENT_DISPATCH_RENEW_INTERVAL_S": "1",
    "CRASH_SINK_DIR": str(sink),
    "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
}
os.environ.update({k: env[k] for k in ("AGENT_DISPATCH_DATA_DIR", "TASK_QUEUE_BACKEND")})
subprocess.run([sys.executable, "-m", "agentdispatch", "migrate"], env=env, check=True)

procs: dict[int, subprocess.Popen[bytes]] = {}
killed_at: dict[int, float] = {}
logs = []


def spawn(slot: int) -> None:
    log = (root / f"worker{slot}-{len(logs)}.log").open("wb")
    logs.append(Path(log.name))
    procs[slot] = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "32", "--app", "async_app:registry",
         *(["--name", f"audit-w{slot}"] if os.environ.get("NAMED", "1") == "1" else []), "--grace", "5"],
        env=env, stdout=log, stderr=log,
    )  # fmt: skip


for s in range(WORKERS):
    spawn(s)

VIA = os.environ.get("SUBMIT_VIA", "python")
http = None
if VIA == "http":
    import httpx
    from kit import start_gateway

    logs.append(root / "gateway.log")
    gw, gport = start_gateway(env, logs[-1], "--no-auth")
    http = httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=60)
settings = load_settings()
store, transport = open_backends(settings)
dispatcher = Dispatcher(store, transport, settings)
jobs: list[str] = []
submit_errors: list[str] = []


def submitter() -> None:
    for i in range(TURNS // SESSIONS):
        for s in range(SESSIONS):
            try:
                if http is not None:
                    r = http.post("/v1/jobs", json={"kind": "audit_turn", "tenant": "t", "session_id": f"s{s}",
                                                    "payload": {"i": i}})  # fmt: skip
                    if r.status_code != 202:
                        submit_errors.append(f"http {r.status_code}: {r.text[:200]}")
                        continue
                    jobs.append(r.json()["job_id"])
                    continue
                h = dispatcher.submit(Submission(kind="audit_turn", tenant="t", session_id=f"s{s}", payload={"i": i}))
                jobs.append(h.job_id)
            except Exception as exc:
                submit_errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(float(os.environ.get("ROUND_SLEEP", "0.3")))


t0 = time.time()
th = threading.Thread(target=submitter)
th.start()
kills = 0


def terminal() -> Counter[str]:
    return Counter(store.get(j, "t").status.value for j in list(jobs))


while True:
    time.sleep(random.uniform(2.5, 3.5))
    done = terminal()
    if not th.is_alive() and sum(done[k] for k in ("succeeded", "failed", "dead_letter", "cancelled")) == TURNS:
        break
    if time.time() - t0 > 600:
        break
    slot = random.randrange(WORKERS)
    p = procs[slot]
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at[p.pid] = time.time()
    kills += 1
    spawn(slot)
    print(f"t={time.time() - t0:5.1f}s kill #{kills} slot {slot}; {dict(done)}", flush=True)

elapsed = time.time() - t0
# Let in-flight drain stop cleanly.
for p in procs.values():
    p.send_signal(signal.SIGTERM)
for p in procs.values():
    print("worker exit", p.wait(timeout=30))
th.join()
if http is not None:
    gw.terminate()
    print("gateway exit", gw.wait(timeout=30))
final = terminal()
report = analyse(sink, killed_at)
bad_text = []
for log in logs:
    text = log.read_text()
    for needle in ("database is locked", "SQLITE_BUSY", "Traceback", "busy"):
        if needle in text:
            bad_text.append(f"{log.name}: {needle}")
reasons = Counter((store.get(j, "t").status.value, store.get(j, "t").reason) for j in jobs)
print(f"elapsed {elapsed:.1f}s, kills {kills}, submitted {len(jobs)}, submit errors {len(submit_errors)}")
print("final statuses", dict(final), "reasons", dict(reasons))
print(
    f"lost/stuck (non-terminal): {TURNS - sum(final[k] for k in ('succeeded', 'failed', 'dead_letter', 'cancelled'))}"
)
print(f"effects {len(report.effects)}, duplicate effects {report.duplicate_effects}, starts {report.starts}")
print(f"overlaps {len(report.overlaps)}, out of order {len(report.out_of_order)}, takeovers {len(report.takeovers)}")
print("overlap sample", report.overlaps[:5], "disorder sample", report.out_of_order[:5])
print("error text in worker logs:", bad_text[:20])
print("submit errors sample:", submit_errors[:5])
print("root", root)
