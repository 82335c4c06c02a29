""":class:`engine.Tx` over one PostgreSQL transaction.

Reads go out at once; inserts, saves, provenance rows and envelopes are
buffered and written in a few multi-row statements before the next read and
before COMMIT. A bulk submit of thousands of
items is therefore a handful of statements, while the engine's semantics (and
the order in which a reader would see the writes) stay those of one statement
per write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ...envelope import Envelope
from ...policy import opaque_ref
from ...sqlfiles import Queries
from ...stores.base import Effect
from ...stores.rows import (
    blocker_wait,
    effect_from_row,
    effect_params,
    insert_params,
    item_from_row,
    mutable_params,
)
from ...workitem import WorkItem, evolve
from .db import Conn

Q = Queries("agentdispatch.backends.postgres.sql", "queries.sql")

_INSERT_COLS = (
    "seq", "id", "tenant", "session_id", "session_ref", "kind", "agent_name", "payload", "priority",
    "status", "reason", "attempts", "max_attempts", "dependencies", "deadline_unix", "created_at",
    "ready_at", "updated_at", "lease_epoch",
)  # fmt: skip
_EVENT_COLS = ("job_id", "at", "event", "status", "attempt", "epoch", "detail")
_EFFECT_COLS = ("tenant", "key", "job_id", "state", "epoch", "result")
_ENQUEUE_COLS = (
    "job_id", "item_seq", "session_ref", "tenant_ref", "group_ref", "priority", "deadline_unix",
    "envelope", "enqueued_at", "visible_at",
)  # fmt: skip


#: A submission of up to this many items is small (the usual API call): its
#: write is one statement with the COMMIT. Bulk goes as binary column arrays.
SMALL_SUBMISSION = 8

#: Buffered writes of up to this many rows ride with the next statement or the
#: COMMIT as text (a ledger batch, a batch of commits): one round trip less.
#: More go as binary column arrays, which encode faster.
DEFER_ROWS = 64

#: Columns sent as ``float8[]``: binary arrays must not mix ``int`` and ``float``.
_FLOAT_COLS = frozenset(
    (
        "deadline_unix", "created_at", "ready_at", "updated_at", "completed_at", "lease_expires_at", "at",
        "enqueued_at", "visible_at",
    )
)  # fmt: skip
_SAVE_COLS = (
    "id", "status", "reason", "attempts", "max_attempts", "ready_at", "updated_at", "completed_at",
    "lease_owner", "lease_epoch", "lease_token", "lease_expires_at", "result", "error",
)  # fmt: skip


def _columns(rows: list[dict[str, Any]], cols: Sequence[str]) -> dict[str, list[Any]]:
    """Column arrays of ``rows``, for the ``unnest`` statements. They travel as
    binary arrays (``%(name)b``): psycopg's text array dumper escapes every JSON
    string with a regular expression, which dominated bulk submits."""
    out: dict[str, list[Any]] = {}
    for c in cols:
        values = [r[c] for r in rows]
        if c in _FLOAT_COLS:
            values = [None if v is None else float(v) for v in values]
        out[c] = values
    return out


def _key_params(keys: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    return {"tenants": [t for t, _ in keys], "keys": [k for _, k in keys]}


class PostgresTx:
    """The SQL of :class:`engine.Tx` inside one open PostgreSQL transaction."""

    def __init__(self, conn: Conn, ref_key: bytes) -> None:
        self.c = conn
        self.ref_key = ref_key
        self._now: float | None = None
        self._seqs: list[int] = []
        self._prefetched: dict[str, WorkItem | None] = {}
        #: Items read by :meth:`read_item` that nothing depends on.
        self._leaves: set[str] = set()
        #: The admitted depth read by :meth:`read_submit`.
        self._depth: int | None = None
        #: Item id -> (blocker status, blocker lease expiry), read with a claim's item.
        self._blockers: dict[str, tuple[str | None, float | None]] = {}
        self._inserts: list[dict[str, Any]] = []
        self._saves: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._enqueues: list[dict[str, Any]] = []
        #: Ledger rows to upsert (``effects_write``), and the clock they carry.
        self._effects: list[dict[str, Any]] = []
        self._effects_now = 0.0
        #: Ledger rows read (and locked) with the items: (tenant, key) -> row,
        #: for keys read; None once written over (see :meth:`read_items`).
        self._effects_read: dict[tuple[str, str], Effect] | None = None
        self._effects_keys: frozenset[tuple[str, str]] = frozenset()
        #: While :meth:`streaming`: send the buffered rows every this many items.
        self._chunk: int | None = None

    # -- buffering ------------------------------------------------------------
    def flush(self, *, last: bool = False) -> None:
        """Write every buffered row (inserts first: saves may update them;
        ledger rows last). ``last``: nothing of this transaction's own reads
        follows, so a few rows' writes ride with the next statement or the COMMIT."""
        if last and self._defer_writes():
            return
        self._flush_items(last)
        if self._effects:
            params = _columns(self._effects, _EFFECT_COLS)
            self.c.execute(Q["effects_write"], {**params, "now": self._effects_now}, binary=True)
            self._effects.clear()

    def _defer_writes(self) -> bool:
        """Defer the buffered saves, provenance rows and ledger rows (text
        rides with the next statement); False when there are inserts or
        envelopes, or too many rows (nothing is deferred then)."""
        if self._inserts or self._enqueues:
            return False
        if len(self._saves) + len(self._events) + len(self._effects) > DEFER_ROWS:
            return False
        if len(self._saves) == 1 and len(self._events) <= 1:
            params = dict(self._saves[0])
            if self._events:
                params.update({f"e_{k}": v for k, v in self._events[0].items()})
            self.c.defer(Q["save_event" if self._events else "save"], params)
        elif self._saves:
            self.c.defer(Q["save_many"], self._save_many_params())
        elif self._events:
            self.c.defer(Q["event_many"], _columns(self._events, _EVENT_COLS))
        if self._effects:
            self.c.defer(Q["effects_write"], {**_columns(self._effects, _EFFECT_COLS), "now": self._effects_now})
        self._saves.clear()
        self._events.clear()
        self._effects.clear()
        return True

    def _save_many_params(self) -> dict[str, list[Any]]:
        # One row per item, its last write (the same row and the same trigger
        # deltas as writing them one after another).
        newest = list({r["id"]: r for r in self._saves}.values())
        params = _columns(newest, _SAVE_COLS)
        params.update({f"e_{k}": v for k, v in _columns(self._events, _EVENT_COLS).items()})
        return params

    def _flush_items(self, last: bool) -> None:
        if not (self._inserts or self._saves or self._events or self._enqueues):
            return
        # Plain round trips: for the usual two or three statements they beat
        # entering pipeline mode; executemany pipelines many saves by itself.
        # Arrays travel in binary: text-format array quoting dominates bulk submits.
        if not self._inserts and not self._enqueues and len(self._saves) == 1 and len(self._events) == 1:
            # The hot path of a commit: one statement instead of two.
            params = dict(self._saves[0])
            params.update({f"e_{k}": v for k, v in self._events[0].items()})
            self.c.execute(Q["save_event"], params)
            self._saves.clear()
            self._events.clear()
            return
        if not self._inserts and not self._enqueues and len(self._saves) > 1:
            # A batch of commits (or claims): every write and provenance row in one statement.
            self.c.execute(Q["save_many"], self._save_many_params(), binary=True)
            self._saves.clear()
            self._events.clear()
            return
        if self._inserts and self._enqueues and not self._saves:
            # The usual submission: items, events and envelopes in one statement.
            if last and len(self._inserts) <= SMALL_SUBMISSION:
                # A small one (the usual API call) rides with the COMMIT: one
                # round trip less before the caller has its handle.
                self.c.defer(Q["submit_write"], self._submit_params())
            else:
                self.c.execute(Q["submit_write"], self._submit_params(), binary=True)
            self._inserts.clear()
            self._events.clear()
            self._enqueues.clear()
            return
        if self._inserts:
            self.c.execute(Q["insert_many"], _columns(self._inserts, _INSERT_COLS), binary=True)
        if len(self._saves) == 1:
            self.c.execute(Q["save"], self._saves[0])
        elif self._saves:
            self.c.send_pending()
            self.c.cursor().executemany(Q["save"], self._saves)
        if self._events:
            self.c.execute(Q["event_many"], _columns(self._events, _EVENT_COLS), binary=True)
        if self._enqueues:
            # Submission order is enqueue order (row ids); the trigger that
            # upserts fairness rows sorts its keys, so writers lock in one order.
            self.c.execute(Q["enqueue_many"], _columns(self._enqueues, _ENQUEUE_COLS), binary=True)
        self._inserts.clear()
        self._saves.clear()
        self._events.clear()
        self._enqueues.clear()

    @contextmanager
    def streaming(self, chunk: int) -> Iterator[None]:
        """Plan a bulk write while the server writes: every ``chunk`` planned
        items go out as one statement in pipeline mode (sent at once, its
        answer read when the block ends), so the server inserts a chunk while
        the client plans the next. Reads inside still work (they wait for the
        writes before them); errors surface at the end of the block, the
        transaction then fails as a whole."""
        self.c.send_pending()  # BEGIN cannot ride in pipeline mode
        self._chunk = chunk
        try:
            with self.c.pipeline():
                yield
                self.flush()
        finally:
            self._chunk = None

    def _submit_params(self) -> dict[str, list[Any]]:
        params = _columns(self._inserts, _INSERT_COLS)
        params.update({f"e_{k}": v for k, v in _columns(self._events, _EVENT_COLS).items()})
        params.update({f"q_{k}": v for k, v in _columns(self._enqueues, _ENQUEUE_COLS).items()})
        return params

    def _one(self, sql: str, params: Any = None) -> dict[str, Any] | None:
        self.flush()
        return self.c.execute(sql, params).fetchone()

    def _all(self, sql: str, params: Any = None) -> list[dict[str, Any]]:
        self.flush()
        return self.c.execute(sql, params).fetchall()

    # -- bulk helpers used by PostgresStore.submit ------------------------------
    def prefetch(self, job_ids: Sequence[str]) -> None:
        """Load (and lock) many items in one query; each answers one ``load``."""
        ids = sorted(set(job_ids))
        found = {r["id"]: item_from_row(r) for r in self._all(Q["load_many"], {"ids": ids})}
        self._prefetched = {i: found.get(i) for i in ids}

    def read_item(self, job_id: str, *, session: bool = False) -> None:
        """The clock and one item, locked, in one round trip (the read half of
        a claim, renewal or commit). With ``session``, also take the item's
        session lock and read what blocks the session (:meth:`session_blocker`)."""
        row = self._one(Q["item_read"], {"id": job_id, "session": session})
        assert row is not None
        self.use_read(job_id, row, session=session)

    def use_read(self, job_id: str, row: dict[str, Any], *, session: bool) -> None:
        """Take the answer of a ``dispatch_item_read`` made in this transaction
        (by :meth:`read_item`, or by the statement that delivered the item)."""
        self._now = float(row["now"])
        data = row["item"]
        self._prefetched[job_id] = None if data is None else item_from_row(data)
        if data is not None and row["leaf"]:
            self._leaves.add(job_id)
        if data is not None and session:
            self._blockers[job_id] = (row["blocker_status"], row["blocker_expires_at"])

    def read_items(self, job_ids: Sequence[str], effects: Sequence[tuple[str, str]] = ()) -> None:
        """The clock and many items, locked in id order, with whether anything
        depends on each, in one round trip (the read half of a batch's commits).
        With ``effects``, the ledger rows of those (tenant, key) pairs are read
        and locked after the items in the same round trip, for the next
        :meth:`effects_read` of some of them (a ledger batch)."""
        ids = sorted(set(job_ids))
        if effects:
            self.flush()
            keys = sorted(set(effects))
            rows, ledger = self.c.fetch_sets([(Q["items_read"], {"ids": ids}), (Q["effects_read"], _key_params(keys))])
            self._effects_read = {(r["tenant"], r["key"]): effect_from_row(r) for r in ledger}
            self._effects_keys = frozenset(keys)
        else:
            rows = self._all(Q["items_read"], {"ids": ids})
        found: dict[str, WorkItem] = {}
        for row in rows:
            self._now = float(row["now"])
            item = item_from_row(row["item"])
            found[item.id] = item
            if row["leaf"]:
                self._leaves.add(item.id)
        self._prefetched.update({i: found.get(i) for i in ids})

    def read_submit(self, job_ids: Sequence[str], n: int, max_depth: int | None = None) -> None:
        """Admission (``dispatch_admission``: exact, and without a global lock
        while far from ``max_depth``), clock, admitted depth, ``n`` sequence
        numbers and the existing items among ``job_ids`` (locked): one round trip."""
        ids = sorted(set(job_ids))
        row = self._one(Q["submit_read"], {"ids": ids, "n": n, "max": max_depth})
        assert row is not None
        self._now = float(row["now"])
        self._depth = int(row["depth"])
        self._seqs = [int(x) for x in reversed(row["seqs"] or [])]
        found = {r["id"]: item_from_row(r) for r in (row["items"] or [])}
        self._prefetched = {i: found.get(i) for i in ids}

    def plan_new(self, job_ids: Sequence[str], at: float) -> None:
        """Plan a submission of new items without reading anything: none of
        ``job_ids`` exists, the clock is ``at`` (the client's) and admission
        is left to :meth:`write_new`, which checks all three as it writes."""
        self._now = at
        self._depth = 0
        self._prefetched = dict.fromkeys(job_ids)
        self._seqs = [0] * len(job_ids)  # drawn by the write

    def write_new(self, max_depth: int) -> dict[str, Any]:
        """The rows planned after :meth:`plan_new`, in one statement
        (``dispatch_submit_new``); its answer says whether they were written."""
        row = self.c.execute(Q["submit_new"], self.planned_rows(max_depth)).fetchone()
        assert row is not None
        return row

    def planned_rows(self, max_depth: int) -> dict[str, Any]:
        """The rows planned after :meth:`plan_new`, as the arguments of
        ``dispatch_submit_new`` (taken: the buffers are emptied)."""
        assert not self._saves and self._now is not None
        params = {
            "max": max_depth,
            "at": self._now,
            "items": json.dumps(self._inserts),
            "events": json.dumps(self._events),
            "queue": json.dumps(self._enqueues),
        }
        self._inserts.clear()
        self._events.clear()
        self._enqueues.clear()
        return params

    def reserve_seqs(self, n: int) -> None:
        """Allocate ``n`` item sequence numbers in one round trip."""
        rows = self._all(Q["next_seqs"], {"n": n})
        self._seqs = [int(r["seq"]) for r in reversed(rows)]

    # -- engine.Tx ------------------------------------------------------------
    def now(self) -> float:
        if self._now is None:
            row = self._one(Q["now"])
            assert row is not None
            self._now = float(row["now"])
        return self._now

    def load(self, job_id: str, *, lock: bool = True) -> WorkItem | None:
        if job_id in self._prefetched:
            return self._prefetched.pop(job_id)
        row = self._one(Q["load_lock" if lock else "load"], {"id": job_id})
        return None if row is None else item_from_row(row)

    def session_ref(self, item: WorkItem) -> str:
        """The keyed opaque reference of the item's session."""
        return opaque_ref(self.ref_key, "session", item.tenant, item.session_id)

    def insert(self, item: WorkItem) -> WorkItem:
        if self._chunk is not None and len(self._inserts) >= self._chunk and not self._saves:
            self.flush()  # the items planned so far: whole, the next starts here
        if not self._seqs:
            self.reserve_seqs(1)
        item = evolve(item, seq=self._seqs.pop())
        params = insert_params(item, self.session_ref(item))
        params["seq"] = item.seq
        self._inserts.append(params)
        return item

    def save(self, item: WorkItem) -> None:
        self._saves.append(mutable_params(item))

    def event(self, item: WorkItem, event: str, detail: str | None = None) -> None:
        self._events.append(
            {
                "job_id": item.id,
                "at": self.now(),
                "event": event,
                "status": item.status.value,
                "attempt": item.attempt,
                "epoch": item.lease_epoch,
                "detail": detail,
            }
        )

    def enqueue(self, item: WorkItem, envelope: Envelope, visible_at: float) -> None:
        ref = self.session_ref(item)
        self._enqueues.append(
            {
                "job_id": item.id,
                "item_seq": item.seq,
                "session_ref": ref,
                "tenant_ref": opaque_ref(self.ref_key, "tenant", item.tenant),
                "group_ref": ref,  # the fairness group is the session
                "priority": item.priority,
                "deadline_unix": item.deadline_unix,
                "envelope": envelope.to_json(),
                "enqueued_at": self.now(),
                "visible_at": visible_at,
            }
        )

    def has_envelope(self, job_id: str) -> bool:
        return self._one(Q["has_envelope"], {"id": job_id}) is not None

    def add_dependencies(self, job_id: str, deps: Sequence[str]) -> None:
        self.flush()
        self.c.send_pending()
        self.c.cursor().executemany(Q["add_dependency"], [(d, job_id) for d in deps])

    def dependants(self, job_id: str) -> list[str]:
        if job_id in self._leaves:
            return []  # read_item found none, after taking the item's lock
        return [r["job_id"] for r in self._all(Q["dependants"], {"id": job_id})]

    def active_count(self) -> int:
        if self._depth is not None and not (self._inserts or self._saves):
            depth, self._depth = self._depth, None
            return depth  # read under admission by read_submit, before any write of ours
        row = self._one(Q["admission_exact"])
        assert row is not None
        return int(row["n"])

    def admitted_depth(self, n: int, max_depth: int) -> int:
        """The depth to compare ``n`` new items against ``max_depth`` with,
        exact under concurrent submitters (see ``dispatch_admission``)."""
        if self._depth is not None and not (self._inserts or self._saves):
            depth, self._depth = self._depth, None
            return depth
        row = self._one(Q["admission"], {"n": n, "max": max_depth})
        assert row is not None
        return int(row["n"])

    def session_blocker(self, item: WorkItem, now: float) -> float | None:
        blocker = self._blockers.pop(item.id, None)
        if blocker is not None:
            # Read under the session lock with the item (read_item(session=True)
            # or the get that delivered it); the lock is held to COMMIT, so no
            # other claim of the session has run since.
            status, expires = blocker
        else:
            ref = self.session_ref(item)
            # The lock comes first, in its own statement, so that the blocker query's
            # snapshot (taken when it starts) includes the previous holder's commit.
            self._one(Q["session_lock"], {"session_ref": ref})
            row = self._one(Q["session_blocker"], {"session_ref": ref, "id": item.id, "seq": item.seq})
            if row is None:
                return None
            status, expires = row["status"], row["lease_expires_at"]
        return blocker_wait(status, expires, now)

    def effect_get(self, tenant: str, key: str) -> Effect | None:
        row = self._one(Q["effect_get"], {"tenant": tenant, "key": key})
        return None if row is None else effect_from_row(row)

    def effect_put(self, tenant: str, effect: Effect, now: float) -> None:
        self.flush()
        self._effects_read = None
        self.c.execute(Q["effect_put"], effect_params(tenant, effect, now))

    def effect_settle(self, tenant: str, effect: Effect, now: float) -> bool:
        self.flush()
        self._effects_read = None
        return self.c.execute(Q["effect_settle"], effect_params(tenant, effect, now)).rowcount == 1

    def effects_read(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Effect]:
        read = self._effects_read
        if read is not None and self._effects_keys.issuperset(keys):
            # Read and locked by read_items, and nothing of ours wrote them since.
            return {k: read[k] for k in keys if k in read}
        return {(r["tenant"], r["key"]): effect_from_row(r) for r in self._all(Q["effects_read"], _key_params(keys))}

    def effects_write(self, rows: Sequence[tuple[str, Effect]], now: float) -> None:
        # Buffered (see flush): a ledger batch's rows ride with its COMMIT.
        if self._effects and now != self._effects_now:
            self.flush()
        self._effects_read = None
        self._effects.extend(effect_params(t, e, now) for t, e in rows)
        self._effects_now = now

    def effects_of(self, job_id: str) -> list[Effect]:
        return [effect_from_row(r) for r in self._all(Q["effects_of"], {"id": job_id})]

    def expired_leases(self, now: float, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._all(Q["expired_leases"], {"now": now, "limit": limit})]

    def held_by(self, owner_prefix: str, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._all(Q["held_by"], {"prefix": owner_prefix, "limit": limit})]

    def release_claims(self, owner_prefix: str, now: float) -> None:
        self.c.execute(Q["release_claims"], {"prefix": owner_prefix, "now": now})

    def forget_worker(self, worker_id: str) -> None:
        self.c.execute(Q["remove_worker"], {"id": worker_id, "final": None})

    def held_suspects(self, owner_prefix: str) -> list[tuple[str, int, int]]:
        rows = self._all(Q["held_suspects"], {"prefix": owner_prefix})
        return [(r["lease_owner"], int(r["attempts"]), int(r["max_attempts"])) for r in rows]

    def expired_deadlines(self, now: float, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._all(Q["expired_deadlines"], {"now": now, "limit": limit})]

    def stranded(self, now: float, redeliver_after_s: float, limit: int) -> list[WorkItem]:
        rows = self._all(Q["stranded"], {"now": now, "grace": redeliver_after_s, "limit": limit})
        return [item_from_row(r) for r in rows]

    def settled_waiters(self, limit: int) -> list[WorkItem]:
        return [item_from_row(r) for r in self._all(Q["settled_waiters"], {"limit": limit})]

    def unserve(self, item: WorkItem) -> None:
        self.flush()
        self.c.execute(Q["unserve"], {"priority": item.priority, "group_ref": self.session_ref(item)})

    def drop_dead_rows(self) -> int:
        self.flush()
        dropped = len(self.c.execute(Q["drop_dead_rows"]).fetchall())
        # Fairness rows a concurrent claim kept from being pruned at their ack.
        self.c.execute(Q["fair_sweep"], {"limit": 1000})
        return dropped
