"""Heartbeat rows in ``dispatch_workers`` and the topology view."""

from __future__ import annotations

import hashlib
import secrets
import socket
from typing import Any

from .stores.base import Fleet, WorkerRow

LIVE_FOR_S = 90.0


def new_worker_id() -> str:
    """An opaque worker token (no host, user or path in it)."""
    return "w-" + secrets.token_hex(8)


def host_label() -> str:
    """An opaque, stable label for this host: a hash, never the name."""
    return "host-" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:10]


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
