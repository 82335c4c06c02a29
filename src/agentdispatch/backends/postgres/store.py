"""The PostgreSQL store: WorkItems shared by a fleet of hosts.

The store logic is :mod:`engine`'s, run over :class:`PostgresTx`. Row locks
(``SELECT ... FOR UPDATE``) make each transition atomic; transaction-level
advisory locks make compare-and-admit exact (one of 16 tokens far from the
bound, all of them near it) and serialize per-session claims. Every
time is the database's clock.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import psycopg

from ... import workitem as wi
from ...errors import JobNotFound, LeaseLost, TaskQueueUnavailable
from ...stores import engine, schema
from ...stores.base import (
    Accepted,
    Activity,
    Claim,
    Effect,
    EffectState,
    JobFilter,
    LedgerAnswer,
    LedgerOp,
    NewJob,
    OldestSnapshot,
    OutboxRow,
    Schedule,
    SweepReport,
    TenantCount,
    WorkerRow,
)
from ...stores.ledger import ledger_batch
from ...stores.rows import (
    advance_params,
    effect_from_row,
    item_from_row,
    outbox_row_of,
    schedule_from_row,
    schedule_params,
    worker_from_row,
)
from ...workitem import Lease, Outcome, Status, WorkItem
from .compact import Compactor
from .db import ANSWER_S, Conn, PgDb, describe, scalar
from .tx import SMALL_SUBMISSION, PostgresTx, Q

T = TypeVar("T")
_SQL_PKG = "agentdispatch.backends.postgres.sql"
#: How long a worker-side write waits for a restarting database before it
#: gives up (the lease TTL gives the turn slack meanwhile).
WORKER_PATIENCE_S = 20.0
#: A bulk submission streams its rows in chunks of this many items (see
#: :meth:`PostgresTx.streaming`); a smaller one is written in one statement.
BULK_CHUNK = 200


class PostgresStore:
    """The WorkItem authority on PostgreSQL (``STATE_DB_URI``)."""

    name = "postgres"

    def __init__(
        self,
        uri: str,
        *,
        extra_attempts: int = 5,
        pool_size: int = 32,
        pool_timeout_s: float = 10.0,
        prepared: bool = True,
        answer_s: float | None = ANSWER_S,
    ) -> None:
        self.db = PgDb(uri, max_size=pool_size, timeout_s=pool_timeout_s, prepared=prepared, answer_s=answer_s)
        self.extra_attempts = extra_attempts
        self._ref_key: bytes | None = None
        self._compact = Compactor(self.db)

    # -- plumbing -------------------------------------------------------------
    def _key(self) -> bytes:
        if self._ref_key is None:
            try:
                value = self.db.read(lambda c: scalar(c, Q["meta_get"], {"key": "ref_key"}))
            except TaskQueueUnavailable as exc:
                if "UndefinedTable" not in str(exc):
                    raise  # the database is unreachable, not unmigrated
                value = None
            if value is None:
                raise TaskQueueUnavailable("the PostgreSQL store has no schema; run `agentdispatch migrate`")
            self._ref_key = bytes.fromhex(value)
        return self._ref_key

    def _run(
        self,
        op: Callable[[PostgresTx], T],
        *,
        durable: bool = False,
        idempotent: bool = False,
        patience_s: float = 0.0,
    ) -> T:
        key = self._key()

        def body(conn: Conn) -> T:
            tx = PostgresTx(conn, key)
            result = op(tx)
            tx.flush(last=True)  # may ride with the COMMIT (or the next statement)
            return result

        return self.db.run(body, durable=durable, idempotent=idempotent, patience_s=patience_s)

    @contextmanager
    def transaction(self, durable: bool = False) -> Iterator[PostgresTx]:
        """One write transaction as an :class:`engine.Tx` (for extensions such
        as durable intake that must write in the same transaction)."""
        key = self._key()
        with self.db.transaction(durable) as conn:
            tx = PostgresTx(conn, key)
            yield tx
            tx.flush()

    def migrate(self) -> None:
        """Apply the schema steps this database lacks (one transaction)."""

        def apply(conn: Conn) -> None:
            conn.execute(Q["migrate_lock"])
            conn.execute(schema.CREATE_VERSIONS)
            applied = int(scalar(conn, Q["schema_version"]))
            has_schema = bool(scalar(conn, Q["schema_present"]))
            for step in schema.pending(_SQL_PKG, applied, has_schema=has_schema):
                conn.execute(step.sql.encode())  # bytes: no parameter parsing of the script
                conn.execute(Q["schema_step_done"], {"version": step.version, "name": step.name})
            conn.execute(
                "INSERT INTO dispatch_meta (key, value) VALUES ('ref_key', %s) ON CONFLICT DO NOTHING",
                (secrets.token_hex(32),),
            )

        # A step may rebuild a big table's index: no bound on the server's answers.
        self.db.run(apply, durable=True, answer_s=math.inf)

    def schema_version(self) -> int:
        def q(conn: Conn) -> int:
            try:
                with conn.transaction():
                    return int(scalar(conn, Q["schema_version"]))
            except psycopg.errors.UndefinedTable:
                return 0

        return self.db.read(q)

    def ping(self) -> None:
        want = schema.latest(_SQL_PKG)
        have = self.schema_version()
        if have < want:
            raise TaskQueueUnavailable(
                f"PostgreSQL schema version {have} is older than {want}; run `agentdispatch migrate`"
            )

    def close(self) -> None:
        self.db.close()

    # -- lifecycle --------------------------------------------------------------
    def submit(self, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        # The one-statement path plans times on this host's clock and shifts them
        # onto the database's, which would move an absolute not_before too.
        # A timeout is one more statement: the general path.
        if len(jobs) <= SMALL_SUBMISSION and not any(
            j.dependencies or j.not_before is not None or j.timeout_s is not None for j in jobs
        ):
            accepted = self._submit_new(jobs, max_depth)
            if accepted is not None:
                return accepted

        return self._run(lambda tx: self.submit_in(tx, jobs, max_depth=max_depth), durable=True)

    def submit_in(self, tx: PostgresTx, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        """:meth:`submit` (its general path) inside an open transaction of
        this store (durable intake writes the receipt in the same one)."""
        # Admission first: submitters of the same job id see each other.
        tx.read_submit([j.job_id for j in jobs], len(jobs), max_depth)
        bulk = len(jobs) >= 2 * BULK_CHUNK
        with tx.streaming(BULK_CHUNK) if bulk else nullcontext():
            accepted = engine.submit(tx, jobs, max_depth)
        if not any(j.timeout_s is not None for j in jobs):
            return accepted
        accepted, pairs = engine.with_timeouts(jobs, accepted)
        if pairs:
            tx.flush()
            tx.c.execute(Q["set_timeouts"], {"ids": [p[0] for p in pairs], "seconds": [p[1] for p in pairs]})
        return accepted

    def plan_new(self, conn: Conn, jobs: Sequence[NewJob], max_depth: int) -> tuple[list[Accepted], dict[str, Any]]:
        """A submission of new items planned without a read (as
        :meth:`_submit_new` plans it, on this host's clock): the items, and
        ``dispatch_submit_new``'s arguments for a statement that calls it
        inside a larger one (durable intake's ``dispatch_intake_admit``)."""
        tx = PostgresTx(conn, self._key())
        tx.plan_new([j.job_id for j in jobs], time.time())
        accepted = engine.submit(tx, jobs, max_depth)
        return accepted, tx.planned_rows(max_depth)

    def _submit_new(self, jobs: Sequence[NewJob], max_depth: int) -> list[Accepted] | None:
        """A small submission without dependencies (the usual API call) in one
        statement (bulk is faster as binary arrays on the general path): the engine
        plans it as if every id were new, ``dispatch_submit_new`` checks that,
        admits and writes. None when an id exists already (nothing written)."""
        key = self._key()
        ids = [j.job_id for j in jobs]

        def body(conn: Conn) -> tuple[list[Accepted], dict[str, Any]]:
            tx = PostgresTx(conn, key)
            tx.plan_new(ids, time.time())
            accepted = engine.submit(tx, jobs, max_depth)
            return accepted, tx.write_new(max_depth)

        accepted, row = self.db.run(body, durable=True, single=True)
        if row["outcome"] == "exists":
            return None
        if row["outcome"] == "full":
            raise engine.queue_full(int(row["depth"]), max_depth)
        # The rows' times moved onto the database clock, and their sequence numbers.
        shift = float(row["shift"])
        seqs = iter(int(s) for s in row["seqs"])
        written: dict[str, WorkItem] = {}
        for a in accepted:
            if a.created:
                i = a.item
                written[i.id] = wi.evolve(
                    i,
                    seq=next(seqs),
                    created_at=i.created_at + shift,
                    ready_at=i.ready_at + shift,
                    updated_at=i.updated_at + shift,
                )
        return [Accepted(written[a.item.id], created=a.created) for a in accepted]

    def claim(self, job_id: str, tenant: str, *, owner: str, ttl_s: float) -> Claim:
        return self.claim_many([(job_id, tenant)], owner=owner, ttl_s=ttl_s)[0]

    def claim_many(self, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float) -> list[Claim]:
        return self._run(lambda tx: _claims(tx, [(j, t, None) for j, t in jobs], owner, ttl_s))

    def _on(self, conn: Conn, op: Callable[[PostgresTx], T]) -> T:
        """``op`` in the open transaction of ``conn`` (a batch verb's: see flow.py)."""
        tx = PostgresTx(conn, self._key())
        result = op(tx)
        tx.flush(last=True)  # may ride with the next statement or the COMMIT
        return result

    def claim_on(
        self, conn: Conn, jobs: Sequence[tuple[str, str, dict[str, Any] | None]], *, owner: str, ttl_s: float
    ) -> list[Claim]:
        """:meth:`claim_many` in the open transaction of ``conn``; each job's
        third member is the item row the get that delivered it read in this
        transaction (its locks still hold, so it is not stale), or None."""
        return self._on(conn, lambda tx: _claims(tx, jobs, owner, ttl_s))

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        def op(tx: PostgresTx) -> Lease:
            tx.read_item(lease.job_id)
            return engine.renew(tx, lease, ttl_s)

        return self._run(op, idempotent=True)

    def renew_many(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        if not leases:
            return []
        return self._run(lambda tx: _renewals(tx, leases, ttl_s), idempotent=True)

    def renew_on(self, conn: Conn, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        """:meth:`renew_many` in the open transaction of ``conn``."""
        return self._on(conn, lambda tx: _renewals(tx, leases, ttl_s))

    def commit(self, lease: Lease, outcome: Outcome) -> WorkItem:
        done = self.commit_many([(lease, outcome)])[0]
        if isinstance(done, LeaseLost):
            raise done
        return done

    def commit_many(self, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        # Idempotent: a repeat of the same fenced commits is a no-op.
        return self._run(lambda tx: _commits(tx, done), durable=True, idempotent=True, patience_s=WORKER_PATIENCE_S)

    def commit_on(self, conn: Conn, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        """:meth:`commit_many` in the open transaction of ``conn``."""
        return self._on(conn, lambda tx: _commits(tx, done))

    def cancel(self, job_id: str, tenant: str | None, reason: str = "cancelled") -> WorkItem:
        return self._run(lambda tx: engine.cancel(tx, job_id, tenant, reason), durable=True, idempotent=True)

    def replay(self, job_id: str, tenant: str | None) -> WorkItem:
        return self._run(lambda tx: engine.replay(tx, job_id, tenant, self.extra_attempts), durable=True)

    # -- reads ------------------------------------------------------------------
    def _item(self, conn: Conn, job_id: str, tenant: str | None) -> WorkItem:
        row = conn.execute(Q["load"], {"id": job_id}).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise JobNotFound(job_id)
        return item_from_row(row)

    def get(self, job_id: str, tenant: str | None) -> WorkItem:
        return self.db.read(lambda c: self._item(c, job_id, tenant))

    def list_jobs(
        self,
        *,
        tenant: str | None,
        status: Status | None,
        limit: int,
        offset: int,
        filters: JobFilter | None = None,
    ) -> list[WorkItem]:
        params: dict[str, Any] = {
            "tenant": tenant,
            "status": None if status is None else status.value,
            "limit": limit,
            "offset": offset,
        }
        if filters:
            params.update(filters.params())
        query = Q["search"] if filters else Q["list"]
        rows = self.db.read(lambda c: c.execute(query, params).fetchall())
        return [item_from_row(r) for r in rows]

    def ready_due(self, *, now: float, limit: int) -> list[WorkItem]:
        """Ready items due by ``now`` (unix), oldest ready first, at most ``limit``."""
        rows = self.db.read(lambda c: c.execute(Q["ready_due"], {"now": now, "limit": limit}).fetchall())
        return [item_from_row(r) for r in rows]

    def counts(self, tenant: str | None) -> dict[str, int]:
        rows = self.db.read(lambda c: c.execute(Q["counts"], {"tenant": tenant}).fetchall())
        return {r["status"]: int(r["n"]) for r in rows}

    def fleet_counts(self) -> list[TenantCount]:
        rows = self.db.read(lambda c: c.execute(Q["fleet_counts"]).fetchall())
        return [TenantCount(r["tenant"], r["status"], int(r["n"]), float(r["oldest"])) for r in rows]

    def oldest_snapshot(self) -> OldestSnapshot | None:
        row = self.db.read(lambda c: c.execute(Q["oldest_snapshot"]).fetchone())
        return None if row is None else OldestSnapshot(float(row["age_s"]), row["pid"], str(row["state"]))

    def compact(self, *, quiet_s: float) -> list[str]:
        return self._compact(quiet_s)

    def history(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        def q(conn: Conn) -> dict[str, Any]:
            item = self._item(conn, job_id, tenant)
            events = conn.execute(Q["events_of"], {"id": job_id}).fetchall()
            effects = [effect_from_row(r) for r in conn.execute(Q["effects_of"], {"id": job_id})]
            return {
                "job": item.view(),
                "payload": item.payload,
                "events": [dict(e) for e in events],
                "side_effects": [
                    {"key": e.key, "state": e.state, "epoch": e.epoch, "result": e.result} for e in effects
                ],
            }

        return self.db.read(q)

    def depth_breakdown(self, tenant: str | None) -> list[tuple[str, str, str, int]]:
        rows = self.db.read(lambda c: c.execute(Q["depth_breakdown"], {"tenant": tenant}).fetchall())
        return [(r["tenant"], r["kind"], r["status"], int(r["n"])) for r in rows]

    def activity(self, tenant: str | None, *, since: float, bucket_s: float) -> Activity:
        params = {"tenant": tenant, "since": since, "bucket": bucket_s}

        def q(conn: Conn) -> Activity:
            start = int(scalar(conn, Q["activity_open"], params) or 0)
            created = {int(r["bucket"]): int(r["n"]) for r in conn.execute(Q["activity_created"], params)}
            finished: dict[int, dict[str, int]] = {}
            for r in conn.execute(Q["activity_finished"], params):
                finished.setdefault(int(r["bucket"]), {})[r["status"]] = int(r["n"])
            return Activity(since, bucket_s, start, created, finished)

        return self.db.read(q)

    def purge_dead(self, job_ids: Sequence[str], tenant: str | None) -> list[str]:
        ids = list(dict.fromkeys(job_ids))

        def op(tx: PostgresTx) -> list[str]:
            return [r["id"] for r in tx.c.execute(Q["purge_dead"], {"ids": ids, "tenant": tenant}).fetchall()]

        gone = set(self._run(op, durable=True, idempotent=True))
        return [i for i in ids if i in gone]

    # -- side effects, poison -------------------------------------------------
    def effect_begin(self, lease: Lease, key: str, ttl_s: float, *, retry_unknown: bool = False) -> Effect | None:
        # Not idempotent: a repeat after an unknown COMMIT would read its own
        # "intended" mark as an effect in flight. Safe retries only.
        # Wait for a restarting database only while the lease may still be live:
        # past it, another worker may own the turn and the effect must not start.
        patience = max(0.0, min(WORKER_PATIENCE_S, lease.expires_at - time.time()))
        return self._run(
            lambda tx: engine.effect_begin(tx, lease, key, ttl_s, retry_unknown=retry_unknown),
            durable=True,
            patience_s=patience,
        )

    def ledger_many(self, ops: Sequence[LedgerOp]) -> list[LedgerAnswer]:
        if not ops:
            return []
        begins = [op for op in ops if op.state is None]

        def op(tx: PostgresTx) -> list[LedgerAnswer]:
            lost: dict[int, LeaseLost] = {}
            # One round trip reads (and locks, in id order) the items of every
            # op (a begin renews its item, a settlement checks its lease), then
            # their ledger rows; the writes ride with the COMMIT.
            tx.read_items([o.lease.job_id for o in ops], effects=[(o.lease.tenant, o.key) for o in ops])

            def settled(o: LedgerOp, recorded: bool) -> None:
                # As effect_end: a settlement written after the lease ran out
                # stops the handler (another worker may own the turn).
                item = tx.load(o.lease.job_id, lock=False)
                if recorded and not (
                    item is not None and item.lease_token == o.lease.token and wi.lease_is_live(item, tx.now())
                ):
                    lost[id(o)] = LeaseLost(
                        f"job {o.lease.job_id}: lease epoch {o.lease.epoch} expired while recording {o.key!r}"
                    )

            out = ledger_batch(tx, ops, settled=settled)
            return [lost.get(id(o), a) for o, a in zip(ops, out, strict=True)]

        # Not idempotent (a begin repeated after an unknown COMMIT would read its
        # own mark as an effect in flight); waits for a restarting database
        # only while every begin's lease may still be live.
        left = min((b.lease.expires_at for b in begins), default=time.time() + WORKER_PATIENCE_S) - time.time()
        return self._run(op, durable=True, patience_s=max(0.0, min(WORKER_PATIENCE_S, left)))

    def cancelled_since(self, since: float) -> tuple[float, list[str]]:
        row = self.db.read(lambda c: c.execute(Q["cancelled_since"], {"since": since}).fetchone())
        assert row is not None
        return float(row["now"]), [str(i) for i in row["ids"]]

    def effect_end(self, lease: Lease, key: str, *, state: EffectState, result: Any) -> bool:
        # What the attempt saw must outlast a database restart; the write is
        # fenced by the ledger row's epoch, so waiting for it is safe however
        # long. If the lease expired meanwhile (an outage longer than the TTL),
        # the turn may already run elsewhere: stop this handler once it is written.
        def op(tx: PostgresTx) -> tuple[bool, bool]:
            recorded = engine.effect_end(tx, lease, key, state, result)
            item = tx.load(lease.job_id, lock=False)
            live = item is not None and item.lease_token == lease.token and wi.lease_is_live(item, tx.now())
            return recorded, live

        recorded, live = self._run(op, durable=True, idempotent=True, patience_s=WORKER_PATIENCE_S)
        if recorded and not live:
            raise LeaseLost(f"job {lease.job_id}: lease epoch {lease.epoch} expired while recording {key!r}")
        return recorded

    def checkpoint(self, lease: Lease, state: str) -> None:
        params = {
            "id": lease.job_id,
            "tenant": lease.tenant,
            "owner": lease.owner,
            "epoch": lease.epoch,
            "token": lease.token,
            "state": state,
        }
        # One fenced statement in autocommit; a repeat writes the same state.
        saved = self.db.run(
            lambda c: c.execute(Q["checkpoint_save"], params).fetchone() is not None,
            durable=True,
            idempotent=True,
            single=True,
            patience_s=max(0.0, min(WORKER_PATIENCE_S, lease.expires_at - time.time())),
        )
        if not saved:
            raise LeaseLost(f"job {lease.job_id}: lease epoch {lease.epoch} is no longer live; checkpoint not saved")

    def record_poison(self, raw: str, reason: str) -> bool:
        return self._run(
            lambda tx: _poison(tx, raw, reason), durable=True, idempotent=True, patience_s=WORKER_PATIENCE_S
        )

    def poison_on(self, conn: Conn, raw: str, reason: str) -> bool:
        """:meth:`record_poison` in the open transaction of ``conn``."""
        return self._on(conn, lambda tx: _poison(tx, raw, reason))

    def poison(self, *, limit: int) -> list[dict[str, Any]]:
        rows = self.db.read(lambda c: c.execute(Q["poison"], {"limit": limit}).fetchall())
        return [dict(r) for r in rows]

    # -- reconciler, fleet, outbox --------------------------------------------
    def sweep(self, *, redeliver_after_s: float) -> SweepReport:
        return self._run(lambda tx: engine.sweep(tx, redeliver_after_s), durable=True, idempotent=True)

    def reap(self, worker_id: str) -> SweepReport:
        return self._run(lambda tx: engine.reap(tx, worker_id), durable=True, idempotent=True)

    def heartbeat(self, row: WorkerRow) -> None:
        params = (
            row.worker_id,
            row.host,
            row.capacity,
            json.dumps(list(row.active_sessions)),
            row.queue_backend,
            row.started_at,
            row.process,
            json.dumps(dict(row.counters)),
        )
        self.db.run(lambda c: c.execute(Q["heartbeat"], params), idempotent=True)

    def workers(self, *, max_age_s: float = 90.0) -> list[WorkerRow]:
        rows = self.db.read(lambda c: c.execute(Q["workers"], {"max_age": max_age_s}).fetchall())
        return [worker_from_row(r) for r in rows]

    def remove_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        # Idempotent: a retry after a commit whose answer was lost finds no row.
        params = {"id": worker_id, "final": None if counters is None else json.dumps(dict(counters))}
        self.db.run(lambda c: c.execute(Q["remove_worker"], params), idempotent=True)

    def fleet_counters(self) -> dict[str, float]:
        rows = self.db.read(lambda c: c.execute(Q["fleet_counters"]).fetchall())
        return {r["name"]: float(r["value"]) for r in rows}

    def token_create(self, token_id: str, token_hash: str, tenant: str, label: str) -> None:
        def op(tx: PostgresTx) -> None:
            tx.c.execute(Q["token_create"], (token_id, token_hash, tenant, label, tx.now()))

        self._run(op, durable=True)

    def token_revoke(self, token_id: str) -> bool:
        def op(tx: PostgresTx) -> bool:
            return tx.c.execute(Q["token_revoke"], (tx.now(), token_id)).rowcount == 1

        return self._run(op, durable=True)

    def token_lookup(self, token_hash: str) -> str | None:
        value = self.db.read(lambda c: scalar(c, Q["token_lookup"], {"hash": token_hash}))
        return None if value is None else str(value)

    def schedule_add(self, schedule: Schedule) -> bool:
        params = schedule_params(schedule)
        return bool(self.db.run(lambda c: c.execute(Q["schedule_add"], params).rowcount == 1, durable=True))

    def schedules(self, tenant: str | None) -> list[Schedule]:
        rows = self.db.read(lambda c: c.execute(Q["schedules"], {"tenant": tenant}).fetchall())
        return [schedule_from_row(r) for r in rows]

    def schedule_update(self, tenant: str, name: str, *, paused: bool, next_at: float) -> bool:
        params = {"tenant": tenant, "name": name, "paused": paused, "next_at": next_at}
        return bool(self.db.run(lambda c: c.execute(Q["schedule_update"], params).rowcount == 1, durable=True))

    def schedule_delete(self, tenant: str, name: str) -> bool:
        params = {"tenant": tenant, "name": name}
        return bool(self.db.run(lambda c: c.execute(Q["schedule_delete"], params).rowcount == 1, durable=True))

    def schedules_due(self, limit: int) -> tuple[float, list[Schedule]]:
        def q(c: Conn) -> tuple[float, list[Schedule]]:
            rows = c.execute(Q["schedules_due"], {"limit": limit}).fetchall()
            if rows:
                return float(rows[0]["db_now"]), [schedule_from_row(r) for r in rows]
            return float(scalar(c, Q["db_now"], {})), []

        return self.db.read(q)

    def schedule_advance(self, schedule: Schedule, *, next_at: float, last_tick: float, last_job_id: str) -> bool:
        params = advance_params(schedule, next_at, last_tick, last_job_id)
        return bool(self.db.run(lambda c: c.execute(Q["schedule_advance"], params).rowcount == 1, durable=True))

    def outbox_take(self, limit: int) -> list[OutboxRow]:
        rows = self.db.read(lambda c: c.execute(Q["outbox_take"], {"limit": limit}).fetchall())
        return [outbox_row_of(r) for r in rows]

    def outbox_lease(self, owner: str, limit: int, hold_s: float) -> list[OutboxRow]:
        params = {"owner": owner, "limit": limit, "hold": hold_s}
        rows = self.db.run(lambda c: c.execute(Q["outbox_lease"], params).fetchall())
        return sorted((outbox_row_of(r) for r in rows), key=lambda r: r.id)

    def outbox_done(self, row_ids: Sequence[int]) -> None:
        ids = list(row_ids)
        self.db.run(lambda c: c.execute(Q["outbox_done"], {"ids": ids}), idempotent=True)

    def describe_error(self, exc: BaseException) -> str:
        """A credential-free description of a database error (for doctor)."""
        return describe(exc)


# The worker's writes, each over one open transaction (see PostgresStore).
# The hot path reads the clock, the locked item (and for a claim the session
# gate) in one round trip and writes back in one statement; a batch reads with
# the get that delivered it and writes in one statement.


def _claims(
    tx: PostgresTx, jobs: Sequence[tuple[str, str, dict[str, Any] | None]], owner: str, ttl_s: float
) -> list[Claim]:
    # Items are read (and locked) in id order, as every batch locks its rows,
    # and the session lock is only tried (024_claim_tries_session_lock.sql):
    # read in delivery order, claims of the same items deadlocked. A repeated
    # id is read again by its claim, after the first one's write.
    read_ids: set[str] = set()
    for job_id, _tenant, read in sorted(jobs, key=lambda j: j[0]):
        if job_id in read_ids:
            continue
        read_ids.add(job_id)
        if read is None:
            tx.read_item(job_id, session=True)
        else:
            tx.use_read(job_id, read, session=True)
    return [engine.claim(tx, job_id, tenant, owner, ttl_s) for job_id, tenant, _read in jobs]


def _renewals(tx: PostgresTx, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
    params = {
        "ids": [x.job_id for x in leases],
        "tenants": [x.tenant for x in leases],
        "owners": [x.owner for x in leases],
        "epochs": [x.epoch for x in leases],
        "tokens": [x.token for x in leases],
        "ttl": ttl_s,
    }
    # One UPDATE renews every live lease (rows locked in id order, as every
    # batch locks them); only a refused one is read back.
    rows = tx.c.execute(Q["renew_many"], params).fetchall()
    done = {(r["id"], r["lease_token"]): float(r["lease_expires_at"]) for r in rows}
    return engine.renewed(tx, leases, done)


def _commits(tx: PostgresTx, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
    if len(done) == 1:
        tx.read_item(done[0][0].job_id)  # one plain function call
    else:
        tx.read_items([lease.job_id for lease, _ in done])
    out: list[WorkItem | LeaseLost] = []
    for lease, outcome in done:
        try:
            out.append(engine.commit(tx, lease, outcome))
        except LeaseLost as exc:  # raised before it writes anything
            out.append(exc)
    return out


def _poison(tx: PostgresTx, raw: str, reason: str) -> bool:
    digest = hashlib.sha256(raw.encode()).hexdigest()
    return tx.c.execute(Q["record_poison"], (digest, raw[:65536], reason, tx.now())).fetchone() is not None
