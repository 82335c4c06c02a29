"""The SQLite store: WorkItems in one WAL file, for one host."""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ...envelope import Envelope
from ...errors import LeaseLost, TaskQueueUnavailable
from ...policy import opaque_ref
from ...sqlfiles import Queries, compact
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
    OutboxRow,
    Schedule,
    SweepReport,
    TenantCount,
    WorkerRow,
)
from ...stores.ledger import ledger_batch
from ...stores.rows import (
    advance_params,
    blocker_wait,
    effect_from_row,
    effect_params,
    insert_params,
    item_from_row,
    mutable_params,
    outbox_row_of,
    schedule_from_row,
    schedule_params,
    worker_from_row,
)
from ...workitem import Lease, Outcome, Status, WorkItem, evolve
from .db import SqliteDb, clock

_SQL_PKG = "agentdispatch.backends.sqlite.sql"
Q = Queries(_SQL_PKG, "queries.sql")


class SqliteTx:
    """:class:`engine.Tx` over one open ``BEGIN IMMEDIATE`` transaction.

    After :meth:`buffer` (a bulk submit), inserts, saves and provenance rows
    are kept in call order and written with ``executemany`` before the next
    read and at :meth:`flush`: the order a reader sees is that of one
    statement per write, with a fraction of the per-statement cost."""

    def __init__(self, conn: sqlite3.Connection, ref_key: bytes) -> None:
        self.c = conn
        self.ref_key = ref_key
        self._now: float | None = None
        self._prefetched: dict[str, WorkItem | None] = {}
        self._pending: list[tuple[str, Any]] | None = None
        self._next_seq = 0
        #: Items read by :meth:`read_item` that nothing depends on.
        self._leaves: set[str] = set()
        #: (item id, blocker status, blocker lease expiry) read by a claim's :meth:`read_item`.
        self._blocker: tuple[str, str | None, float | None] | None = None

    # -- buffering ------------------------------------------------------------
    def buffer(self) -> None:
        """Buffer writes from here on; item sequence numbers are assigned here
        (the write lock is held, so no other writer takes them)."""
        row = self.c.execute(Q["last_seq"]).fetchone()
        self._next_seq = int(row[0]) + 1
        self._pending = []

    def flush(self) -> None:
        """Write every buffered row: one ``executemany`` per statement, the
        statements in the order each was first called, the rows in call order.
        A submit calls insert, event, (save,) enqueue for each item in turn, so
        every item's insert still precedes its save, and event ids keep the
        order of the calls (grouping only consecutive rows ran one statement
        per row)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        groups: dict[str, list[Any]] = {}
        for sql, params in pending:
            groups.setdefault(sql, []).append(params)
        for sql, rows in groups.items():
            self.c.executemany(sql, rows)

    def _write(self, sql: str, params: Any) -> None:
        if self._pending is None:
            self.c.execute(sql, params)
        else:
            self._pending.append((sql, params))

    def _read(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if self._pending:
            self.flush()
        return self.c.execute(sql, params)

    def prefetch(self, job_ids: Sequence[str]) -> None:
        """Load many items in one query; each answers one :meth:`load`."""
        ids = sorted(set(job_ids))
        found = {r["id"]: item_from_row(r) for r in self._read(Q["load_many"], (json.dumps(ids),))}
        self._prefetched = {i: found.get(i) for i in ids}

    def read_item(self, job_id: str, *, session: bool = False) -> None:
        """The item, whether anything depends on it and (with ``session``) what
        blocks its session, in one statement: the read half of a claim or commit."""
        row = self._read(Q["item_read"], {"id": job_id, "session": session}).fetchone()
        if row is None:
            self._prefetched[job_id] = None
            return
        self._prefetched[job_id] = item_from_row(row)
        if row["leaf"]:
            self._leaves.add(job_id)
        if session:
            self._blocker = (job_id, row["blocker_status"], row["blocker_expires_at"])

    def now(self) -> float:
        if self._now is None:
            self._now = clock()
        return self._now

    def load(self, job_id: str, *, lock: bool = True) -> WorkItem | None:
        if job_id in self._prefetched:
            return self._prefetched.pop(job_id)
        row = self._read(Q["load"], (job_id,)).fetchone()
        return None if row is None else item_from_row(row)

    def session_ref(self, item: WorkItem) -> str:
        return opaque_ref(self.ref_key, "session", item.tenant, item.session_id)

    def insert(self, item: WorkItem) -> WorkItem:
        params = insert_params(item, self.session_ref(item))
        if self._pending is None:
            params["seq"] = None
            seq = self.c.execute(Q["insert"], params).lastrowid
            assert seq is not None
            return evolve(item, seq=seq)
        params["seq"] = seq = self._next_seq
        self._next_seq += 1
        self._pending.append((Q["insert"], params))
        return evolve(item, seq=seq)

    def save(self, item: WorkItem) -> None:
        self._write(Q["save"], mutable_params(item))

    def event(self, item: WorkItem, event: str, detail: str | None = None) -> None:
        self._write(
            Q["event"],
            (item.id, self.now(), event, item.status.value, item.attempt, item.lease_epoch, detail),
        )

    def enqueue(self, item: WorkItem, envelope: Envelope, visible_at: float) -> None:
        self._write(
            Q["enqueue"],
            (
                item.id,
                item.seq,
                self.session_ref(item),
                opaque_ref(self.ref_key, "tenant", item.tenant),
                item.priority,
                item.deadline_unix,
                envelope.to_json(),
                self.now(),
                visible_at,
            ),
        )

    def has_envelope(self, job_id: str) -> bool:
        return self._read(Q["has_envelope"], (job_id,)).fetchone() is not None

    def add_dependencies(self, job_id: str, deps: Sequence[str]) -> None:
        self._leaves.difference_update(deps)
        self.flush()
        self.c.executemany(Q["add_dependency"], [(d, job_id) for d in deps])

    def dependants(self, job_id: str) -> list[str]:
        if job_id in self._leaves:
            return []  # read_item found none, under this transaction's write lock
        return [r[0] for r in self._read(Q["dependants"], (job_id,))]

    def active_count(self) -> int:
        return int(self._read(Q["active_count"]).fetchone()[0])

    def session_blocker(self, item: WorkItem, now: float) -> float | None:
        if self._blocker is not None and self._blocker[0] == item.id:
            _, status, expires = self._blocker  # read by read_item, under the write lock
        else:
            row = self._read(
                Q["session_blocker"],
                {"session_ref": self.session_ref(item), "id": item.id, "seq": item.seq},
            ).fetchone()
            if row is None:
                return None
            status, expires = row["status"], row["lease_expires_at"]
        return blocker_wait(status, expires, now)

    def effect_get(self, tenant: str, key: str) -> Effect | None:
        row = self._read(Q["effect_get"], (tenant, key)).fetchone()
        return None if row is None else effect_from_row(row)

    def effect_put(self, tenant: str, effect: Effect, now: float) -> None:
        self._write(Q["effect_put"], effect_params(tenant, effect, now))

    def effect_settle(self, tenant: str, effect: Effect, now: float) -> bool:
        return self._read(Q["effect_settle"], effect_params(tenant, effect, now)).rowcount == 1

    def effects_read(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Effect]:
        rows = self._read(Q["effects_read"], (json.dumps(keys),))
        return {(r["tenant"], r["key"]): effect_from_row(r) for r in rows}

    def effects_write(self, rows: Sequence[tuple[str, Effect]], now: float) -> None:
        self.flush()
        self.c.executemany(Q["effect_put"], [effect_params(t, e, now) for t, e in rows])

    def effects_of(self, job_id: str) -> list[Effect]:
        return [effect_from_row(r) for r in self._read(Q["effects_of"], (job_id,))]

    def expired_leases(self, now: float, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._read(Q["expired_leases"], (now, limit))]

    def held_by(self, owner_prefix: str, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._read(Q["held_by"], {"prefix": owner_prefix, "limit": limit})]

    def release_claims(self, owner_prefix: str, now: float) -> None:
        self._write(Q["release_claims"], {"prefix": owner_prefix, "now": now})

    def forget_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        final = None if counters is None else json.dumps(dict(counters))
        self._write(Q["fold_worker"], {"id": worker_id, "final": final})
        self._write(Q["remove_worker"], {"id": worker_id})

    def held_suspects(self, owner_prefix: str) -> list[tuple[str, int, int]]:
        rows = self._read(Q["held_suspects"], {"prefix": owner_prefix})
        return [(r["lease_owner"], int(r["attempts"]), int(r["max_attempts"])) for r in rows]

    def expired_deadlines(self, now: float, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._read(Q["expired_deadlines"], (now, limit))]

    def stranded(self, now: float, redeliver_after_s: float, limit: int) -> list[WorkItem]:
        rows = self._read(Q["stranded"], {"now": now, "grace": redeliver_after_s, "limit": limit})
        return [item_from_row(r) for r in rows]

    def settled_waiters(self, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._read(Q["settled_waiters"], (limit,))]

    def drop_dead_rows(self) -> int:
        return self._read(Q["drop_dead_rows"]).rowcount

    def unserve(self, item: WorkItem) -> None:
        self._write(Q["unserve"], (item.id,))


class SqliteStore:
    """The WorkItem authority in one SQLite file (WAL, BEGIN IMMEDIATE)."""

    name = "sqlite"

    def __init__(self, path: Path | SqliteDb, *, extra_attempts: int = 5) -> None:
        self.db = path if isinstance(path, SqliteDb) else SqliteDb(path)
        self.extra_attempts = extra_attempts
        self._ref_key: bytes | None = None
        #: The last item sequence number :meth:`wait_for_submission` saw.
        self._seen_seq: int | None = None

    # -- plumbing -----------------------------------------------------------
    def transaction(self, durable: bool = False) -> AbstractContextManager[SqliteTx]:
        """One write transaction as an :class:`engine.Tx` (for extensions such
        as durable intake that must write in the same transaction)."""
        return self._tx(durable)

    def _tx(self, durable: bool = False) -> _StoreTx:
        return _StoreTx(self.db.tx(durable), self._key())

    def _key(self) -> bytes:
        if self._ref_key is None:
            row = self.db.conn().execute("SELECT value FROM dispatch_meta WHERE key = 'ref_key'").fetchone()
            if row is None:
                raise TaskQueueUnavailable("the SQLite queue has no schema; run `agentdispatch migrate`")
            self._ref_key = bytes.fromhex(row[0])
        return self._ref_key

    def migrate(self) -> None:
        """Apply the schema steps this database lacks (one transaction)."""
        with self.db.tx(durable=True) as c:
            c.execute(schema.CREATE_VERSIONS)
            applied = int(c.execute("SELECT coalesce(max(version), 0) FROM dispatch_migrations").fetchone()[0])
            has_schema = c.execute("SELECT 1 FROM sqlite_master WHERE name = 'dispatch_meta'").fetchone() is not None
            for step in schema.pending(_SQL_PKG, applied, has_schema=has_schema):
                for statement in _statements(step.sql):
                    c.execute(statement)
                c.execute(
                    "INSERT INTO dispatch_migrations (version, name, applied_at) "
                    "VALUES (?, ?, (julianday('now') - 2440587.5) * 86400.0)",
                    (step.version, step.name),
                )
            c.execute(
                "INSERT OR IGNORE INTO dispatch_meta (key, value) VALUES ('ref_key', ?)",
                (secrets.token_hex(32),),
            )

    def schema_version(self) -> int:
        try:
            row = self.db.conn().execute("SELECT max(version) FROM dispatch_migrations").fetchone()
        except sqlite3.OperationalError:
            return 0
        return int(row[0] or 0)

    def ping(self) -> None:
        want = schema.latest(_SQL_PKG)
        have = self.schema_version()
        if have < want:
            raise TaskQueueUnavailable(
                f"SQLite schema version {have} is older than {want}; run `agentdispatch migrate`"
            )

    def close(self) -> None:
        self.db.close()

    # -- lifecycle ----------------------------------------------------------
    def submit(self, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        with self._tx(durable=True) as tx:
            return self.submit_in(tx, jobs, max_depth=max_depth)

    def submit_in(self, tx: SqliteTx, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        """:meth:`submit` inside an open transaction of this store (durable
        intake writes the receipt of the submission in the same one)."""
        tx.prefetch([j.job_id for j in jobs])
        tx.buffer()
        accepted = engine.submit(tx, jobs, max_depth)
        tx.flush()
        if not any(j.timeout_s is not None for j in jobs):
            return accepted
        accepted, pairs = engine.with_timeouts(jobs, accepted)
        if pairs:
            tx.c.execute(Q["set_timeouts"], (json.dumps(pairs),))
        return accepted

    def claim(self, job_id: str, tenant: str, *, owner: str, ttl_s: float) -> Claim:
        with self._tx() as tx:
            tx.read_item(job_id, session=True)
            return engine.claim(tx, job_id, tenant, owner, ttl_s)

    def claim_many(self, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float) -> list[Claim]:
        # One write transaction for the batch (a queue elsewhere, Kafka, would
        # otherwise pay a transaction per claim).
        with self.db.tx() as c:
            return self.claim_on(c, jobs, owner=owner, ttl_s=ttl_s)

    def claim_on(
        self, c: sqlite3.Connection, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float
    ) -> list[Claim]:
        """:meth:`claim_many` in the open transaction of ``c``."""
        key = self._key()
        out: list[Claim] = []
        for job_id, tenant in jobs:
            tx = SqliteTx(c, key)  # one per claim: its clock and reads are its own
            tx.read_item(job_id, session=True)
            out.append(engine.claim(tx, job_id, tenant, owner, ttl_s))
        return out

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        with self._tx() as tx:
            return engine.renew(tx, lease, ttl_s)

    def renew_many(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        if not leases:
            return []
        with self.db.tx() as c:
            return self.renew_on(c, leases, ttl_s)

    def renew_on(self, c: sqlite3.Connection, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        """:meth:`renew_many` in the open transaction of ``c``."""
        tx = SqliteTx(c, self._key())
        # One UPDATE renews every live lease: its cost is the rows it
        # rewrites, not a statement (and item decode) per lease.
        now = tx.now()
        payload = json.dumps([[x.job_id, x.tenant, x.owner, x.epoch, x.token] for x in leases])
        rows = tx.c.execute(Q["renew_many"], {"leases": payload, "now": now, "until": now + ttl_s})
        done = {(r[0], r[1]): float(r[2]) for r in rows}
        return engine.renewed(tx, leases, done)

    def commit(self, lease: Lease, outcome: Outcome) -> WorkItem:
        with self._tx(durable=True) as tx:
            tx.read_item(lease.job_id)
            return engine.commit(tx, lease, outcome)

    def commit_many(self, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        # One durable transaction (one fsync) for the batch, as above.
        with self.db.tx(durable=True) as c:
            return self.commit_on(c, done)

    def commit_on(self, c: sqlite3.Connection, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        """:meth:`commit_many` in the open transaction of ``c``; a fenced
        commit raises before it writes, so it costs the others nothing."""
        key = self._key()
        out: list[WorkItem | LeaseLost] = []
        for lease, outcome in done:
            tx = SqliteTx(c, key)
            tx.read_item(lease.job_id)
            try:
                out.append(engine.commit(tx, lease, outcome))
            except LeaseLost as exc:
                out.append(exc)
        return out

    def cancel(self, job_id: str, tenant: str | None, reason: str = "cancelled") -> WorkItem:
        with self._tx(durable=True) as tx:
            return engine.cancel(tx, job_id, tenant, reason)

    def replay(self, job_id: str, tenant: str | None) -> WorkItem:
        with self._tx(durable=True) as tx:
            return engine.replay(tx, job_id, tenant, self.extra_attempts)

    # -- reads --------------------------------------------------------------
    def get(self, job_id: str, tenant: str | None) -> WorkItem:
        from ...errors import JobNotFound

        row = self.db.conn().execute(Q["load"], (job_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise JobNotFound(job_id)
        return item_from_row(row)

    def list_jobs(
        self,
        *,
        tenant: str | None,
        status: Status | None,
        limit: int,
        offset: int,
        filters: JobFilter | None = None,
    ) -> list[WorkItem]:
        params = {
            "tenant": tenant,
            "status": None if status is None else status.value,
            "limit": limit,
            "offset": offset,
        }
        if filters:
            params.update(filters.params())
        rows = self.db.conn().execute(Q["search"] if filters else Q["list"], params)
        return [item_from_row(r) for r in rows]

    def ready_due(self, *, now: float, limit: int) -> list[WorkItem]:
        """Ready items due by ``now`` (unix), oldest ready first, at most ``limit``."""
        return [item_from_row(r) for r in self.db.conn().execute(Q["ready_due"], {"now": now, "limit": limit})]

    def counts(self, tenant: str | None) -> dict[str, int]:
        rows = self.db.conn().execute(Q["counts"], {"tenant": tenant})
        return {r["status"]: int(r["n"]) for r in rows}

    def fleet_counts(self) -> list[TenantCount]:
        rows = self.db.conn().execute(Q["fleet_counts"])
        return [TenantCount(r["tenant"], r["status"], int(r["n"]), float(r["oldest"])) for r in rows]

    def history(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        item = self.get(job_id, tenant)
        conn = self.db.conn()
        events = [dict(r) for r in conn.execute(Q["events_of"], (job_id,))]
        effects = [
            {"key": e.key, "state": e.state, "epoch": e.epoch, "result": e.result}
            for e in (effect_from_row(r) for r in conn.execute(Q["effects_of"], (job_id,)))
        ]
        return {"job": item.view(), "payload": item.payload, "events": events, "side_effects": effects}

    def depth_breakdown(self, tenant: str | None) -> list[tuple[str, str, str, int]]:
        rows = self.db.conn().execute(Q["depth_breakdown"], {"tenant": tenant})
        return [(r["tenant"], r["kind"], r["status"], int(r["n"])) for r in rows]

    def activity(self, tenant: str | None, *, since: float, bucket_s: float) -> Activity:
        params = {"tenant": tenant, "since": since, "bucket": bucket_s}
        conn = self.db.conn()
        # Three statements, three snapshots: a turn finishing between them
        # moves a chart by one item for one refresh, which a chart may do.
        start = int(conn.execute(Q["activity_open"], params).fetchone()["n"])
        created = {int(r["bucket"]): int(r["n"]) for r in conn.execute(Q["activity_created"], params)}
        finished: dict[int, dict[str, int]] = {}
        for r in conn.execute(Q["activity_finished"], params):
            finished.setdefault(int(r["bucket"]), {})[r["status"]] = int(r["n"])
        return Activity(since, bucket_s, start, created, finished)

    def purge_dead(self, job_ids: Sequence[str], tenant: str | None) -> list[str]:
        gone: list[str] = []
        with self._tx(durable=True) as tx:
            for job_id in dict.fromkeys(job_ids):
                if tx.c.execute(Q["purge_dead"], {"id": job_id, "tenant": tenant}).fetchone() is None:
                    continue
                for query in ("purge_events", "purge_dependencies", "purge_queue"):
                    tx.c.execute(Q[query], {"id": job_id})
                gone.append(job_id)
        return gone

    # -- side effects, poison ----------------------------------------------
    def effect_begin(self, lease: Lease, key: str, ttl_s: float, *, retry_unknown: bool = False) -> Effect | None:
        with self._tx(durable=True) as tx:
            return engine.effect_begin(tx, lease, key, ttl_s, retry_unknown=retry_unknown)

    def effect_end(self, lease: Lease, key: str, *, state: EffectState, result: Any) -> bool:
        with self._tx(durable=True) as tx:
            return engine.effect_end(tx, lease, key, state, result)

    def ledger_many(self, ops: Sequence[LedgerOp]) -> list[LedgerAnswer]:
        if not ops:
            return []
        with self._tx(durable=True) as tx:
            # The begins' leases renewed by one statement, as the renewer does.
            return ledger_batch(tx, ops, renew=lambda leases, ttl_s: self.renew_on(tx.c, leases, ttl_s))

    def wait_for_submission(self, timeout_s: float, *, every_s: float = 0.002) -> int:
        """Until an item is submitted to this file, by any process, or
        ``timeout_s`` passes: how many items were submitted since the last
        look (0: none came). A read of the last sequence number every
        ``every_s``: it takes no lock in WAL mode, and neither commits nor
        renewals move it, only new items. One caller at a time (a worker's
        claimer); it remembers what it saw, so a submission that landed while
        the caller was claiming wakes the next call at once."""
        conn = self.db.conn()
        deadline = time.monotonic() + timeout_s
        while True:
            last = int(conn.execute(Q["last_seq"]).fetchone()[0])
            if self._seen_seq is None:
                self._seen_seq = last
            if last > self._seen_seq:
                came, self._seen_seq = last - self._seen_seq, last
                return came
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            time.sleep(min(every_s, left))

    def cancelled_since(self, since: float) -> tuple[float, list[str]]:
        now = self.db.now()
        rows = self.db.conn().execute(Q["cancelled_since"], (since,))
        return now, [str(r[0]) for r in rows]

    def checkpoint(self, lease: Lease, state: str) -> None:
        with self._tx(durable=True) as tx:
            params = _fence_params(lease)
            params.update(state=state, now=tx.now())
            if tx.c.execute(Q["checkpoint_save"], params).rowcount != 1:
                raise _checkpoint_fenced(lease)

    def record_poison(self, raw: str, reason: str) -> bool:
        with self.db.tx(durable=True) as c:
            return self.poison_on(c, raw, reason)

    def poison_on(self, c: sqlite3.Connection, raw: str, reason: str) -> bool:
        """:meth:`record_poison` in the open transaction of ``c``."""
        digest = hashlib.sha256(raw.encode()).hexdigest()
        return c.execute(Q["record_poison"], (digest, raw[:65536], reason, clock())).rowcount == 1

    def poison(self, *, limit: int) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.conn().execute(Q["poison"], (limit,))]

    # -- reconciler, fleet, outbox -----------------------------------------
    def sweep(self, *, redeliver_after_s: float) -> SweepReport:
        with self._tx(durable=True) as tx:
            return engine.sweep(tx, redeliver_after_s)

    def reap(self, worker_id: str) -> SweepReport:
        with self._tx(durable=True) as tx:
            return engine.reap(tx, worker_id)

    def heartbeat(self, row: WorkerRow) -> None:
        with self._tx() as tx:
            tx.c.execute(
                Q["heartbeat"],
                (
                    row.worker_id,
                    row.host,
                    row.capacity,
                    json.dumps(list(row.active_sessions)),
                    row.queue_backend,
                    row.started_at,
                    tx.now(),
                    row.process,
                    json.dumps(dict(row.counters)),
                ),
            )

    def workers(self, *, max_age_s: float = 90.0) -> list[WorkerRow]:
        rows = self.db.conn().execute(Q["workers"], (self.db.now() - max_age_s,))
        return [worker_from_row(r) for r in rows]

    def remove_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        with self._tx() as tx:
            tx.forget_worker(worker_id, counters)

    def fleet_counters(self) -> dict[str, float]:
        return {r["name"]: float(r["value"]) for r in self.db.conn().execute(Q["fleet_counters"])}

    def token_create(self, token_id: str, token_hash: str, tenant: str, label: str) -> None:
        with self._tx(durable=True) as tx:
            tx.c.execute(Q["token_create"], (token_id, token_hash, tenant, label, tx.now()))

    def token_revoke(self, token_id: str) -> bool:
        with self._tx(durable=True) as tx:
            return tx.c.execute(Q["token_revoke"], (tx.now(), token_id)).rowcount == 1

    def token_lookup(self, token_hash: str) -> str | None:
        row = self.db.conn().execute(Q["token_lookup"], (token_hash,)).fetchone()
        return None if row is None else str(row[0])

    def schedule_add(self, schedule: Schedule) -> bool:
        with self._tx(durable=True) as tx:
            params = {**schedule_params(schedule), "now": tx.now()}
            return tx.c.execute(Q["schedule_add"], params).rowcount == 1

    def schedules(self, tenant: str | None) -> list[Schedule]:
        return [schedule_from_row(r) for r in self.db.conn().execute(Q["schedules"], {"tenant": tenant})]

    def schedule_update(self, tenant: str, name: str, *, paused: bool, next_at: float) -> bool:
        with self._tx(durable=True) as tx:
            params = {"tenant": tenant, "name": name, "paused": paused, "next_at": next_at, "now": tx.now()}
            return tx.c.execute(Q["schedule_update"], params).rowcount == 1

    def schedule_delete(self, tenant: str, name: str) -> bool:
        with self._tx(durable=True) as tx:
            return tx.c.execute(Q["schedule_delete"], {"tenant": tenant, "name": name}).rowcount == 1

    def schedules_due(self, limit: int) -> tuple[float, list[Schedule]]:
        now = self.db.now()
        rows = self.db.conn().execute(Q["schedules_due"], {"now": now, "limit": limit})
        return now, [schedule_from_row(r) for r in rows]

    def schedule_advance(self, schedule: Schedule, *, next_at: float, last_tick: float, last_job_id: str) -> bool:
        with self._tx(durable=True) as tx:
            params = {**advance_params(schedule, next_at, last_tick, last_job_id), "now": tx.now()}
            return tx.c.execute(Q["schedule_advance"], params).rowcount == 1

    def outbox_take(self, limit: int) -> list[OutboxRow]:
        rows = self.db.conn().execute(Q["outbox_take"], (limit,))
        return [outbox_row_of(r) for r in rows]

    def outbox_lease(self, owner: str, limit: int, hold_s: float) -> list[OutboxRow]:
        with self._tx() as tx:
            params = {"owner": owner, "now": tx.now(), "hold": hold_s, "limit": limit}
            rows = tx.c.execute(Q["outbox_lease"], params).fetchall()
        return sorted((outbox_row_of(r) for r in rows), key=lambda r: r.id)

    def outbox_done(self, row_ids: Sequence[int]) -> None:
        with self._tx() as tx:
            tx.c.executemany(Q["outbox_done"], [(i,) for i in row_ids])


def _fence_params(lease: Lease) -> dict[str, Any]:
    return {
        "id": lease.job_id,
        "tenant": lease.tenant,
        "owner": lease.owner,
        "epoch": lease.epoch,
        "token": lease.token,
    }


def _checkpoint_fenced(lease: Lease) -> LeaseLost:
    return LeaseLost(f"job {lease.job_id}: lease epoch {lease.epoch} is no longer live; checkpoint not saved")


def _statements(sql: str) -> list[str]:
    """Split a migration into statements: comment lines go first, then split on
    ``;`` (our DDL has no ``;`` inside literals); a trigger's body runs on to its
    ``END``."""
    out: list[str] = []
    body: list[str] = []
    for part in (p.strip() for p in compact(sql).split(";")):
        if not part:
            continue
        if body or part.upper().startswith("CREATE TRIGGER"):
            body.append(part)
            if part.upper() == "END":
                out.append(";\n".join(body))
                body = []
            continue
        out.append(part)
    if body:
        raise ValueError("a CREATE TRIGGER without its END in a migration")
    return out


class _StoreTx:
    """``with store._tx() as tx``: the database transaction as a :class:`SqliteTx`
    (a plain class: it runs twice a turn, where a generator costs more)."""

    __slots__ = ("_cm", "_key")

    def __init__(self, cm: AbstractContextManager[sqlite3.Connection], key: bytes) -> None:
        self._cm = cm
        self._key = key

    def __enter__(self) -> SqliteTx:
        return SqliteTx(self._cm.__enter__(), self._key)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._cm.__exit__(*exc)
