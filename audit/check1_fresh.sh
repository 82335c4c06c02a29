#!/usr/bin/env bash
# Fresh-user path: README commands on a brand-new data dir (XDG default, nothing pre-made).
set -u
T=$(mktemp -d); export XDG_DATA_HOME=$T/xdg HOME=$T/home; mkdir -p $HOME
unset AGENT_DISPATCH_DATA_DIR STATE_DB_URI TASK_QUEUE_BACKEND
echo "== demo"; time agentdispatch demo --turns 100 --sessions 50; echo "rc=$?"
echo "== submit"; agentdispatch submit echo --payload '{"hello": "world"}' --session chat-42 --json; echo "rc=$?"
ID=$(agentdispatch submit echo --payload '{"x":1}' --json | python -c 'import json,sys;print(json.load(sys.stdin)["job_id"])')
timeout 20 agentdispatch worker --concurrency 10 & W=$!
agentdispatch status $ID --wait 15; echo "rc=$?"
kill -TERM $W; wait $W; echo "worker rc=$?"
agentdispatch status $ID --history; agentdispatch jobs | head; agentdispatch doctor; echo "doctor rc=$?"
agentdispatch submit echo --payload '{bad'; echo "bad payload rc=$?"
agentdispatch status dispatch-nope; echo "unknown rc=$?"
ls -la $XDG_DATA_HOME/agentdispatch
rm -rf $T
