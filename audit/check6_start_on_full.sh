#!/usr/bin/env bash
# Start-up on a full disk: doctor, worker, gateway, submit, status, jobs each answer plainly.
set -u
T=$(mktemp -d); D=$T/disk; mkdir $D; mount -t tmpfs -o size=4m tmpfs $D
export AGENT_DISPATCH_DATA_DIR=$D/data TASK_QUEUE_BACKEND=sqlite
agentdispatch migrate >/dev/null && ID=$(agentdispatch submit echo --json | python -c 'import json,sys;print(json.load(sys.stdin)["job_id"])')
python - <<PY
import errno, os
fd = os.open("$D/filler", os.O_WRONLY | os.O_CREAT, 0o600)
for size in (1 << 20, 1 << 12, 1):
    while True:
        try: os.write(fd, b"x" * size)
        except OSError: break
os.close(fd)
PY
df -k $D | tail -1
echo "== doctor"; timeout 60 agentdispatch doctor; echo "rc=$?"
echo "== status"; timeout 60 agentdispatch status $ID | head -3; echo "rc=${PIPESTATUS[0]}"
echo "== submit"; timeout 60 agentdispatch submit echo; echo "rc=$?"
echo "== worker"; timeout 20 agentdispatch worker 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"
echo "== gateway"; timeout 20 agentdispatch gateway --no-auth --port 0 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"
rm $D/filler
echo "== after freeing: worker runs the job"; (timeout 15 agentdispatch worker >/dev/null 2>&1 &) ; agentdispatch status $ID --wait 10 | grep status; 
sleep 1; umount -l $D; rm -rf $T
