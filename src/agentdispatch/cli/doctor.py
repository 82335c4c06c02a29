"""``agentdispatch doctor``: one line per check, OK or FAIL; never prints
host names, user names, file-system paths or secrets."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from ..errors import AgentDispatchError
from ..policy import LEASE_RTO_S, renew_every
from ..settings import Settings
from ..stores.base import Horizon
from .app import App


@dataclass
class Check:
    """One doctor line."""

    name: str
    ok: bool
    detail: str


def _try(name: str, fn: Callable[[], str]) -> Check:
    try:
        return Check(name, True, fn())
    except AgentDispatchError as exc:
        return Check(name, False, str(exc))
    except Exception as exc:  # a doctor reports, it does not crash
        return Check(name, False, type(exc).__name__)


def lease_check(s: Settings) -> Check:
    """``dispatch_lease_recovery``: TTL, renew interval, the 300 s objective."""
    ok = s.claim_ttl_s <= LEASE_RTO_S and s.renew_interval_s < s.claim_ttl_s
    detail = (
        f"claim_ttl_s={s.claim_ttl_s:g} renew_interval_s={s.renew_interval_s:g} "
        f"renews_every_s={renew_every(s.claim_ttl_s, s.renew_interval_s):g} rto_s={LEASE_RTO_S:g} ok={ok}"
    )
    return Check("dispatch_lease_recovery", ok, detail)


def _horizon_check(store: Horizon, alert_s: float) -> Check:
    """``oldest_transaction`` (PostgreSQL): FAIL while one has been open for
    ``AGENT_DISPATCH_PG_XMIN_ALERT_S`` or longer (vacuum cannot clean the queue)."""

    def oldest() -> str:
        held = store.oldest_snapshot()
        if held is None:
            return "none open"
        line = f"{held.holder()}, open {held.age_s:.0f} s"
        if alert_s and held.age_s >= alert_s:
            raise AgentDispatchError(f"{line}: vacuum cannot clean the queue meanwhile; end it")
        return line

    return _try("oldest_transaction", oldest)


def run_checks(obj: App) -> list[Check]:
    """Every check, in order; later checks are skipped when settings fail."""
    try:
        s = obj.settings
    except AgentDispatchError as exc:
        return [Check("settings", False, str(exc))]
    checks = [
        Check("settings", True, f"backend={s.backend.value} max_depth={s.max_depth} max_attempts={s.max_attempts}")
    ]
    checks.append(lease_check(s))

    from ..factory import open_store, open_transport

    # Store and transport are opened one at a time, so that a broker that is
    # down fails the transport line, not the store's, and the store's own
    # checks still answer.
    opened: dict[str, Any] = {}

    def store_ping() -> str:
        store = opened["store"] = open_store(s)
        store.ping()
        return f"{store.name} reachable"

    def transport_ping() -> str:
        transport = open_transport(s, opened["store"])
        transport.ping()
        obj.__dict__.update(store=opened["store"], transport=transport)  # App's, for the checks below
        return f"{transport.name} reachable"

    store_ok = _try("store", store_ping)
    checks.append(store_ok)
    if not store_ok.ok:
        return checks
    checks.append(_try("schema", lambda: f"version {opened['store'].schema_version()}"))
    transport_ok = _try("transport", transport_ping)
    checks.append(transport_ok)
    if not transport_ok.ok:
        checks.append(_try("workers", lambda: f"{len(opened['store'].workers())} live"))
        return checks
    checks.append(_try("queue_depth", lambda: f"{obj.transport.depth()} unclaimed of max {s.max_depth}"))
    checks.append(_try("workers", lambda: f"{len(obj.store.workers())} live"))
    if isinstance(obj.store, Horizon):
        checks.append(_horizon_check(obj.store, s.pg_xmin_alert_s))
    from .gateway import gateway_checks

    checks.extend(gateway_checks(obj))
    return checks


def register(main: click.Group) -> None:
    """Attach ``doctor`` to ``main``."""

    @main.command()
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_obj
    def doctor(obj: App, as_json: bool) -> None:
        """Check configuration, store, transport, schema and workers."""
        from . import emit

        checks = run_checks(obj)
        data: list[dict[str, Any]] = [c.__dict__ for c in checks]

        def human() -> None:
            for c in checks:
                click.echo(f"{'OK  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")

        emit(data, as_json, human)
        sys.exit(0 if all(c.ok for c in checks) else 1)
