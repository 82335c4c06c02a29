"""Heartbeat rows in ``dispatch_workers`` and the topology view."""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from .stores.base import Fleet, WorkerRow

LIVE_FOR_S = 90.0


def new_worker_id() -> str:
    """An opaque worker token (no host, user or path in it)."""
    return "w-" + secrets.token_hex(8)


#: Between a worker's name and the token of one incarnation in its id.
INCARNATION = "@"


def named_worker_id(name: str) -> str:
    """The id of one incarnation of the worker named ``name``."""
    return f"{name}{INCARNATION}{secrets.token_hex(4)}"


def earlier_incarnations(worker_id: str, ids: list[str]) -> list[str]:
    """Those of ``ids`` that name the same worker as ``worker_id`` (a named
    one) in another incarnation."""
    name, sep, _ = worker_id.rpartition(INCARNATION)
    if not sep:
        return []
    return [i for i in ids if i != worker_id and i.rpartition(INCARNATION)[0] == name]


def host_label() -> str:
    """An opaque, stable label for this host: a hash, never the name."""
    return "host-" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:10]


@functools.cache
def _namespace() -> str | None:
    """An opaque name for the set of processes this one can see by pid: the
    host, its boot and the pid namespace (``None`` without ``/proc``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pids = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.sha256(f"{socket.gethostname()}|{boot}|{pids}".encode()).hexdigest()[:12]


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from ``/proc``; ``None`` when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], fields[19]


def process_label(pid: int | None = None) -> str:
    """This process (or ``pid``) as a peer on the same host can check it:
    ``namespace/pid/start time`` (a reused pid has another start time); empty
    where there is no ``/proc`` to check it by."""
    pid = os.getpid() if pid is None else pid
    namespace = _namespace()
    try:
        stat = _stat(pid)
    except (OSError, ValueError, IndexError):
        return ""
    if namespace is None or stat is None:
        return ""
    return f"{namespace}/{pid}/{stat[1]}"


def process_gone(label: str) -> bool:
    """Whether the process ``label`` names has certainly ended: it runs where
    this process can see it by pid, and that pid is free, reused, or a zombie.
    False when that cannot be told (another host, no label)."""
    namespace, _, rest = label.partition("/")
    pid, _, started = rest.partition("/")
    if not started or not pid.isdigit() or namespace != _namespace():
        return False
    try:
        # Existence by signal 0, not by /proc: a /proc mounted with hidepid
        # hides other users' processes, which are there all the same.
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False  # there but another user's (EPERM), or not a pid at all
    try:
        stat = _stat(int(pid))
    except (OSError, ValueError, IndexError):
        return False
    return stat is not None and (stat[1] != started or stat[0] in ("Z", "X"))


def topology(
    store: Fleet, *, tenant_sessions: set[str] | None = None, limit: int = 200, offset: int = 0
) -> dict[str, Any]:
    """The ``/api/fleet/topology`` document. With ``tenant_sessions`` given,
    only those sessions are shown in ``active_sessions``."""
    rows = store.workers(max_age_s=LIVE_FOR_S)
    page = rows[offset : offset + limit]
    workers = []
    sessions: set[str] = set()
    for r in page:
        shown = [s for s in r.active_sessions if tenant_sessions is None or s in tenant_sessions]
        sessions.update(shown)
        workers.append(_row_view(r, shown))
    return {
        "domains": [],
        "goals": [],
        "dispatch_workers": workers,
        "totals": {
            "domains": 0,
            "sessions": len(sessions),
            "dispatch_workers": len(rows),
            "capacity": sum(r.capacity for r in rows),
        },
        "page": {"limit": limit, "offset": offset, "returned": len(workers)},
    }


def _row_view(row: WorkerRow, sessions: list[str]) -> dict[str, Any]:
    return {
        "worker_id": row.worker_id,
        "host": row.host,
        "capacity": row.capacity,
        "active_sessions": sessions,
        "queue_backend": row.queue_backend,
        "started_at": row.started_at,
        "last_heartbeat": row.last_heartbeat,
    }
