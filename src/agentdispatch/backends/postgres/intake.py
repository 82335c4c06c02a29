"""Durable intake on PostgreSQL: the intake tables beside the WorkItems, each
verb one transaction of the store (so a receipt and its WorkItem commit
together). The request path is one statement (``dispatch_intake_admit``)
for each group of concurrent deliveries (:mod:`agentdispatch.intake.group`):
one round trip and one synchronous commit answer all of them."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import psycopg

from ...errors import TaskQueueUnavailable
from ...intake.base import (
    Abandoned,
    Admission,
    Admitted,
    BacklogFull,
    RouteState,
    Row,
    SteerChoice,
    history_entry,
)
from ...intake.envelope import IntakeEnvelope
from ...intake.flush import group_flush
from ...intake.group import Group
from ...sqlfiles import Queries
from ...stores import engine
from ...stores.base import Accepted
from .db import Conn, describe, hint
from .store import PostgresStore
from .tx import PostgresTx

Q = Queries("agentdispatch.backends.postgres.sql", "intake.sql")
_LISTS = {"installations": "inst_list", "agents": "agent_list", "routes": "route_list", "receipts": "receipt_states"}
#: Of the time left before the 503, what the request statement may take: the
#: server cancels it (and nothing commits) before the gateway stops waiting.
STATEMENT_SHARE = 0.8
#: The statement's bound when the caller sets no deadline.
NO_DEADLINE_MS = 60_000
#: Groups of concurrent intakes written at once by one process: one more
#: than one, so a group stalled behind a lock does not hold up every webhook.
GROUPS = 2
#: Seconds a route whose agent has its backlog slots skips ``admit_slots``
#: (slot rows are never deleted; a route changed to a new agent meanwhile
#: gets its slots inside the group, as before that statement existed).
SLOTTED_S = 60.0
#: What the group statement answers a member: its row and planned WorkItem.
_Admit = tuple[Row, list[Accepted]]


class _MemberFailed(Exception):
    """The group's statement failed on the data of one of its deliveries
    (rolled back): nothing of the group is stored."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


def _left_ms(deadline: float | None, now: float) -> int:
    """Of the time left before the 503, what the statement may take: the
    server cancels it (and nothing commits) before the gateway stops waiting."""
    if deadline is None:
        return NO_DEADLINE_MS
    return int((deadline - now) * 1000 * STATEMENT_SHARE)


def _one(c: Conn, name: str, /, **params: Any) -> Row | None:
    row = c.execute(Q[name], params).fetchone()
    return None if row is None else dict(row)


def _all(c: Conn, name: str, /, **params: Any) -> list[Row]:
    return [dict(r) for r in c.execute(Q[name], params).fetchall()]


def _run(c: Conn, name: str, /, **params: Any) -> int:
    return int(c.execute(Q[name], params).rowcount)


def _count(c: Conn, name: str, /, **params: Any) -> int:
    row = _one(c, name, **params)
    return 0 if row is None else int(row["n"])


class PostgresIntakeStore:
    """:class:`~agentdispatch.intake.base.IntakeStore` in the PostgreSQL store's database."""

    #: Gateway threads for the request path: enough for a group to absorb a
    #: stall of the database (a member waits for its group's commit in one).
    request_threads = 32

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self._group: Group[Admission, _Admit] = Group(self._admit_group, concurrency=GROUPS)
        #: (installation, channel, bound) -> until when its agent is known to have slots.
        self._slotted: dict[tuple[str, str, int], float] = {}

    @contextmanager
    def _tx(self, durable: bool = True) -> Iterator[PostgresTx]:
        with self.store.transaction(durable=durable) as tx:
            yield tx

    def _read(self, name: str, /, **params: Any) -> list[Row]:
        with self._tx(durable=False) as tx:
            return _all(tx.c, name, **params)

    def _first(self, name: str, /, **params: Any) -> Row | None:
        rows = self._read(name, **params)
        return rows[0] if rows else None

    # -- the request path ------------------------------------------------------
    def admit(self, a: Admission) -> Admitted:
        admitted = self._admit_one(a)
        if admitted is None:
            admitted = self._admit_general(a)
        return admitted

    def _admit_one(self, a: Admission) -> Admitted | None:
        """Through the group of concurrent intakes (one statement, one
        synchronous commit for all of them). None: take the general path (the
        id is in use without a receipt)."""
        row, accepted = self._group.call(a)
        outcome = row["outcome"]
        if outcome == "exists":
            return None
        if outcome == "backlog_full":
            raise BacklogFull(row["agent"])
        if outcome == "queue_full":
            raise engine.queue_full(a.max_depth, a.max_depth)
        if outcome == "accepted":  # committed synchronously: on disk
            agent = str(row["agent"])
            return Admitted(
                [dataclasses.replace(x, item=dataclasses.replace(x.item, agent_name=agent)) for x in accepted]
            )
        # A duplicate: the original may have committed asynchronously (the
        # general path) a moment ago; answer once it is on disk too.
        group_flush(self.store.db, self.store.db.flush_wal).wait()
        return Admitted([], row)

    def _admit_group(self, group: list[Admission]) -> list[_Admit | BaseException]:
        """One round trip for the group: ``BEGIN``, the statement timeout of
        the member with the least time left, ``admit_group``, a synchronous
        ``COMMIT``, in one message. A member whose caller has stopped waiting
        is left out; an error of the statement fails every member and stores
        none of them."""
        results: list[_Admit | BaseException] = [Abandoned() for _ in group]
        now = time.monotonic()
        live = [
            i
            for i, a in enumerate(group)
            if not (a.abandoned is not None and a.abandoned.is_set())
            and (a.deadline is None or _left_ms(a.deadline, now) >= 1)
        ]
        if not live:
            return results
        # One order for every group of every process: two groups holding
        # copies of the same updates wait for each other, never deadlock.
        live.sort(key=lambda i: (group[i].receipt["connector"], group[i].receipt["source_id"]))
        left_ms = min((_left_ms(group[i].deadline, now) for i in live), default=NO_DEADLINE_MS)
        # The agents' backlog slots first, in one order for every group (see
        # admit_slots): creating them member by member deadlocked. Routes
        # whose slots an earlier group saw skip it (one statement less).
        keys = {
            (str(a.receipt["installation_id"]), a.channel, a.backlog)
            for a in (group[i] for i in live)
            if a.job is not None and a.channel is not None
        }
        routes = [
            {"inst": k[0], "channel": k[1], "bound": k[2]} for k in sorted(keys) if self._slotted.get(k, 0.0) < now
        ]

        def run(conn: Conn) -> dict[int, tuple[Row, list[Accepted]]]:
            planned: dict[int, list[Accepted]] = {}
            cursor = psycopg.ClientCursor(conn)
            values = []
            for i in live:
                a = group[i]
                rows: dict[str, Any] = {"max": a.max_depth, "at": 0.0, "items": "[]", "events": "[]", "queue": "[]"}
                planned[i] = []
                if a.job is not None:  # agent_name: the statement sets the route's
                    planned[i], rows = self.store.plan_new(conn, [a.job], a.max_depth)
                params = {
                    **rows,
                    "n": i,
                    "receipt": json.dumps(a.receipt),
                    "channel": a.channel,
                    "accept": a.job is not None,
                    "bound": a.backlog,
                }
                values.append(cursor.mogrify(Q["admit_row"], params))
            statement = Q["admit_group"].replace("{rows}", ", ".join(values))
            slots = f"{cursor.mogrify(Q['admit_slots'], {'routes': json.dumps(routes)})}; " if routes else ""
            # The statement asks for an asynchronous commit (see
            # dispatch_intake_admit); the group commits synchronously instead:
            # one flush covers every member, with no second round trip.
            message = (
                f"BEGIN; SET LOCAL statement_timeout = {max(1, left_ms)}; {slots}{statement}; "
                "SET LOCAL synchronous_commit = on; COMMIT"
            )
            try:
                cur = conn.execute(message.encode(), prepare=False)
            except psycopg.errors.QueryCanceled:
                conn.execute("ROLLBACK")
                raise Abandoned() from None
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                conn.execute("ROLLBACK")
                raise _MemberFailed(exc) from None
            out: dict[int, tuple[Row, list[Accepted]]] = {}
            while True:
                if cur.description is not None:
                    for r in cur.fetchall():
                        out[int(r["n"])] = (dict(r), planned[int(r["n"])])
                if not cur.nextset():
                    break
            return out

        # Idempotent: run again after a lost connection, it finds the receipts.
        try:
            got = self.store.db.run(run, single=True, idempotent=True)
        except _MemberFailed as failed:
            if len(live) == 1:
                results[live[0]] = TaskQueueUnavailable(
                    f"PostgreSQL transaction failed ({describe(failed.error)}); {hint(failed.error)}"
                )
                return results
            # A delivery the database refuses (its data) must not fail the
            # others of its group on every retry: each alone, then.
            for i in live:
                results[i] = self._admit_group([group[i]])[0]
            return results
        if len(self._slotted) > 10_000:
            self._slotted.clear()
        for k in keys:  # committed: their agents have slots now
            self._slotted[k] = now + SLOTTED_S
        for i in live:
            results[i] = got[i]
        return results

    def _admit_general(self, a: Admission) -> Admitted:
        # A commit that notifies (a new WorkItem wakes workers) holds a
        # cluster-wide lock until it is flushed, so durable intakes took turns
        # at the disk. Commit without waiting for the flush, then wait for it
        # outside that lock.
        with self._tx(durable=False) as tx:
            admitted = self._admit_in(tx, a)
        self.store.db.flush_wal()
        return admitted

    def _admit_in(self, tx: PostgresTx, a: Admission) -> Admitted:
        c, now, r = tx.c, tx.now(), a.receipt
        existing = _one(c, "receipt_by_source", connector=r["connector"], source_id=r["source_id"])
        if existing is not None:
            return Admitted([], _duplicate(c, existing, r["body_sha256"], now))
        agent = ""
        if a.channel is not None:
            route = _one(c, "route_resolve", installation_id=r["installation_id"], channel=a.channel)
            agent = "" if route is None else str(route["agent"])
        if a.job is not None and _count(c, "backlog", agent=agent, bound=a.backlog, job=a.job.job_id) >= a.backlog:
            raise BacklogFull(agent)
        if _one(c, "receipt_insert", **r, agent=agent, now=now) is None:  # a concurrent copy committed first
            existing = _one(c, "receipt_by_source", connector=r["connector"], source_id=r["source_id"])
            assert existing is not None
            return Admitted([], _duplicate(c, existing, r["body_sha256"], now))
        accepted: list[Accepted] = []
        if a.job is not None:
            accepted = self.store.submit_in(tx, [dataclasses.replace(a.job, agent_name=agent)], max_depth=a.max_depth)
        if a.abandoned is not None and a.abandoned.is_set():
            raise Abandoned()
        return Admitted(accepted)

    def refuse(self, receipt: Row) -> None:
        # Asynchronous commits: a record lost in a crash only leaves no trace of a 503.
        with self._tx(durable=False) as tx:
            _one(tx.c, "receipt_insert", **receipt, now=tx.now())

    def forget_refusal(self, connector: str, source_id: str) -> bool:
        with self._tx(durable=False) as tx:
            return _run(tx.c, "receipt_forget_refusal", connector=connector, source_id=source_id) == 1

    def installations(self, connector: str, route_key: str) -> list[Row]:
        return self._read("inst_by_route", connector=connector, route_key=route_key)

    def receipt_by_source(self, connector: str, source_id: str) -> Row | None:
        return self._first("receipt_by_source", connector=connector, source_id=source_id)

    # -- administration --------------------------------------------------------
    def install(self, row: Row) -> None:
        with self._tx() as tx:
            _run(tx.c, "inst_upsert", **row, now=tx.now())

    def set_installation_status(self, inst_id: str, status: str) -> bool:
        with self._tx() as tx:
            return _run(tx.c, "inst_set_status", id=inst_id, status=status, now=tx.now()) == 1

    def set_agent(self, name: str, *, enabled: bool) -> None:
        with self._tx() as tx:
            _run(tx.c, "agent_upsert", name=name, enabled=1 if enabled else 0, now=tx.now())

    def set_route(self, inst_id: str, channel: str, agent: str | None) -> None:
        with self._tx() as tx:
            if agent is None:
                _run(tx.c, "route_delete", installation_id=inst_id, channel=channel)
            else:
                _run(tx.c, "route_set", installation_id=inst_id, channel=channel, agent=agent, now=tx.now())

    def listing(self, what: Literal["installations", "agents", "routes", "receipts"]) -> list[Row]:
        return self._read(_LISTS[what])

    def scrub(self, age_s: float) -> int:
        with self._tx() as tx:
            now = tx.now()
            return _run(tx.c, "scrub", now=now, cutoff=now - age_s)

    # -- the worker-side turn --------------------------------------------------
    def now(self) -> float:
        row = self._first("now")
        assert row is not None
        return float(row["now"])

    def installation(self, inst_id: str) -> Row | None:
        return self._first("inst_get", id=inst_id)

    def receipt(self, receipt_id: str) -> Row | None:
        return self._first("receipt_get", id=receipt_id)

    def bump(self, receipt_id: str, phase: Literal["intake", "turn"]) -> int:
        with self._tx() as tx:
            n = _count(tx.c, f"bump_{phase}", id=receipt_id)
            # Mirrored on the WorkItem (its id is the receipt's) for the operators' SQL.
            _run(tx.c, f"mirror_{phase}", id=receipt_id, n=n)
            return n

    def capture(self, receipt_id: str, entry: Row, *, engage: bool) -> bool:
        with self._tx() as tx:
            collapsed = _run(tx.c, "history_insert", **entry, now=tx.now()) == 0
            _run(tx.c, "mark_captured", id=receipt_id, engaged=1 if engage and not collapsed else 0)
            return collapsed

    def finish(self, receipt_id: str, state: str, reason: str | None = None) -> None:
        with self._tx() as tx:
            _run(tx.c, "finish", id=receipt_id, state=state, reason=reason, now=tx.now())

    def newer_pending(self, receipt: Row) -> list[tuple[str, IntakeEnvelope]]:
        with self._tx(durable=False) as tx:
            return _pending(tx.c, receipt)

    def steer(self, receipt: Row, choose: Callable[[IntakeEnvelope], SteerChoice]) -> list[IntakeEnvelope]:
        taken: list[IntakeEnvelope] = []
        with self._tx() as tx:
            for rid, env in _pending(tx.c, receipt):
                choice = choose(env)
                if choice == "collapse":
                    _run(tx.c, "finish", id=rid, state="collapsed", reason="same_message", now=tx.now())
                elif choice == "steer" and _run(tx.c, "steer", id=rid, job_id=receipt["job_id"], now=tx.now()) == 1:
                    _run(tx.c, "history_insert", **history_entry(env, rid, "user"), now=tx.now())
                    taken.append(env)
        return taken

    def steered_into(self, receipt: Row) -> list[IntakeEnvelope]:
        rows = self._read(
            "steered_of",
            installation_id=receipt["installation_id"],
            conversation=receipt["conversation"],
            job_id=receipt["job_id"],
        )
        return [IntakeEnvelope.from_json(r["envelope"]) for r in rows if r["envelope"]]

    def route_state(self, inst_id: str, channel: str) -> RouteState:
        with self._tx(durable=False) as tx:
            inst = _one(tx.c, "inst_get", id=inst_id)
            if inst is None:
                return RouteState(None, None, False)
            route = _one(tx.c, "route_resolve", installation_id=inst_id, channel=channel)
            if route is None:
                return RouteState(str(inst["status"]), None, False)
            agent = _one(tx.c, "agent_get", name=route["agent"])
            return RouteState(str(inst["status"]), str(route["agent"]), agent is not None and bool(agent["enabled"]))

    def take_slot(self, receipt: Row, *, per_agent: int, per_installation: int, ttl_s: float) -> bool:
        with self._tx() as tx:
            c = tx.c
            # One order for every process: the agent's lock, then the installation's.
            _one(c, "lock", key=f"intake-run:{receipt['agent']}")
            _one(c, "lock", key=f"intake-inst:{receipt['installation_id']}")
            now = tx.now()
            mine = {"job_id": receipt["job_id"], "now": now}
            if _count(c, "runs_of_agent", agent=receipt["agent"], **mine) >= per_agent:
                return False
            if (
                _count(c, "runs_of_installation", installation_id=receipt["installation_id"], **mine)
                >= per_installation
            ):
                return False
            _run(
                c,
                "run_upsert",
                job_id=receipt["job_id"],
                agent=receipt["agent"],
                installation_id=receipt["installation_id"],
                conversation=receipt["conversation"],
                requester=receipt["sender"],
                now=now,
                expires_at=now + ttl_s,
            )
            _run(c, "set_running", id=receipt["id"])
            return True

    def release_slot(self, job_id: str) -> None:
        with self._tx() as tx:
            _run(tx.c, "run_release", job_id=job_id)

    def record_reply(self, receipt_id: str, reply: str, entry: Row) -> None:
        with self._tx() as tx:
            _run(tx.c, "set_reply", id=receipt_id, reply=reply)
            _run(tx.c, "history_insert", **entry, now=tx.now())

    def history(self, inst_id: str, conversation: str, limit: int) -> list[Row]:
        return self._read("history_recent", installation_id=inst_id, conversation=conversation, limit=limit)


def _duplicate(c: Conn, row: Row, digest: str, now: float) -> Row:
    if row["body_sha256"] != digest:
        _run(c, "mismatch_insert", receipt_id=row["id"], body_sha256=digest, now=now)
        _run(c, "mismatch_bump", receipt_id=row["id"])
    return row


def _pending(c: Conn, receipt: Row) -> list[tuple[str, IntakeEnvelope]]:
    rows = _all(
        c,
        "newer_pending",
        installation_id=receipt["installation_id"],
        conversation=receipt["conversation"],
        job_id=receipt["job_id"],
    )
    return [(str(r["id"]), IntakeEnvelope.from_json(r["envelope"])) for r in rows if r["envelope"]]
