"""Durable intake on SQLite: the intake tables in the store's file, each verb
one transaction of the store (so a receipt and its WorkItem commit together)."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

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
from ...sqlfiles import Queries
from ...stores.base import Accepted
from .db import clock
from .store import SqliteStore

Q = Queries("agentdispatch.backends.sqlite.sql", "intake.sql")
_LISTS = {"installations": "inst_list", "agents": "agent_list", "routes": "route_list", "receipts": "receipt_states"}


def _one(c: sqlite3.Connection, name: str, /, **params: Any) -> Row | None:
    row = c.execute(Q[name], params).fetchone()
    return None if row is None else dict(row)


def _all(c: sqlite3.Connection, name: str, /, **params: Any) -> list[Row]:
    return [dict(r) for r in c.execute(Q[name], params).fetchall()]


def _run(c: sqlite3.Connection, name: str, /, **params: Any) -> int:
    return int(c.execute(Q[name], params).rowcount)


class SqliteIntakeStore:
    """:class:`~agentdispatch.intake.base.IntakeStore` in the SQLite store's file."""

    #: Gateway threads for the request path. A delivery waits for its group
    #: commit in one (blocked, holding no GIL), so the threads bound a group:
    #: with the default 8, a slow fsync (15-90 ms on a busy machine) left the
    #: webhooks arriving meanwhile queued for a thread, past the next commit.
    request_threads = 32

    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        # Durable: concurrent callers share one commit (the store's group commit).
        with self.store.transaction(durable=True) as tx:
            yield tx.c

    @contextmanager
    def _short(self) -> Iterator[sqlite3.Connection]:
        with self.store.transaction() as tx:
            yield tx.c

    def _read(self, name: str, /, **params: Any) -> list[Row]:
        # One statement is its own snapshot (WAL): no write transaction. In
        # BEGIN IMMEDIATE it queued for the write lock behind every commit,
        # and the request path's reads (installations, receipts) with it.
        return _all(self.store.db.conn(), name, **params)

    def _first(self, name: str, /, **params: Any) -> Row | None:
        rows = self._read(name, **params)
        return rows[0] if rows else None

    # -- the request path ------------------------------------------------------
    def admit(self, a: Admission) -> Admitted:
        with self.store.transaction(durable=True) as tx:
            c, now, r = tx.c, tx.now(), a.receipt
            existing = _one(c, "receipt_by_source", connector=r["connector"], source_id=r["source_id"])
            if existing is not None:
                return Admitted([], _duplicate(c, existing, r["body_sha256"], now))
            agent = ""
            if a.channel is not None:
                route = _one(c, "route_resolve", installation_id=r["installation_id"], channel=a.channel)
                agent = "" if route is None else str(route["agent"])
            if a.job is not None:
                row = _one(c, "backlog", agent=agent)
                if row is not None and int(row["n"]) >= a.backlog:
                    raise BacklogFull(agent)
            if _one(c, "receipt_insert", **r, agent=agent, now=now) is None:
                # Under the write lock only a collision of derived receipt ids
                # gets here (no receipt of this source): it fails loudly.
                existing = _one(c, "receipt_by_source", connector=r["connector"], source_id=r["source_id"])
                assert existing is not None
                return Admitted([], _duplicate(c, existing, r["body_sha256"], now))
            accepted: list[Accepted] = []
            if a.job is not None:
                job = dataclasses.replace(a.job, agent_name=agent)
                accepted = self.store.submit_in(tx, [job], max_depth=a.max_depth)
            if a.abandoned is not None and a.abandoned.is_set():
                raise Abandoned()
            return Admitted(accepted)

    def refuse(self, receipt: Row) -> None:
        with self._write() as c:
            _one(c, "receipt_insert", **receipt, now=clock())

    def forget_refusal(self, connector: str, source_id: str) -> bool:
        with self._write() as c:
            return _run(c, "receipt_forget_refusal", connector=connector, source_id=source_id) == 1

    def installations(self, connector: str, route_key: str) -> list[Row]:
        return self._read("inst_by_route", connector=connector, route_key=route_key)

    def receipt_by_source(self, connector: str, source_id: str) -> Row | None:
        return self._first("receipt_by_source", connector=connector, source_id=source_id)

    # -- administration --------------------------------------------------------
    def install(self, row: Row) -> None:
        with self._write() as c:
            _run(c, "inst_upsert", **row, now=clock())

    def set_installation_status(self, inst_id: str, status: str) -> bool:
        with self._write() as c:
            return _run(c, "inst_set_status", id=inst_id, status=status, now=clock()) == 1

    def set_agent(self, name: str, *, enabled: bool) -> None:
        with self._write() as c:
            _run(c, "agent_upsert", name=name, enabled=1 if enabled else 0, now=clock())

    def set_route(self, inst_id: str, channel: str, agent: str | None) -> None:
        with self._write() as c:
            if agent is None:
                _run(c, "route_delete", installation_id=inst_id, channel=channel)
            else:
                _run(c, "route_set", installation_id=inst_id, channel=channel, agent=agent, now=clock())

    def listing(self, what: Literal["installations", "agents", "routes", "receipts"]) -> list[Row]:
        return self._read(_LISTS[what])

    def scrub(self, age_s: float) -> int:
        with self._write() as c:
            now = clock()
            return _run(c, "scrub", now=now, cutoff=now - age_s)

    # -- the worker-side turn --------------------------------------------------
    def now(self) -> float:
        return clock()

    def installation(self, inst_id: str) -> Row | None:
        return self._first("inst_get", id=inst_id)

    def receipt(self, receipt_id: str) -> Row | None:
        return self._first("receipt_get", id=receipt_id)

    def bump(self, receipt_id: str, phase: Literal["intake", "turn"]) -> int:
        with self._write() as c:
            row = _one(c, f"bump_{phase}", id=receipt_id)
            n = 0 if row is None else int(row["n"])
            # Mirrored on the WorkItem (its id is the receipt's) for the operators' SQL.
            _run(c, f"mirror_{phase}", id=receipt_id, n=n)
            return n

    def capture(self, receipt_id: str, entry: Row, *, engage: bool) -> bool:
        with self._write() as c:
            collapsed = _run(c, "history_insert", **entry, now=clock()) == 0
            _run(c, "mark_captured", id=receipt_id, engaged=1 if engage and not collapsed else 0)
            return collapsed

    def finish(self, receipt_id: str, state: str, reason: str | None = None) -> None:
        with self._write() as c:
            _run(c, "finish", id=receipt_id, state=state, reason=reason, now=clock())

    def newer_pending(self, receipt: Row) -> list[tuple[str, IntakeEnvelope]]:
        with self._short() as c:
            return _pending(c, receipt)

    def steer(self, receipt: Row, choose: Callable[[IntakeEnvelope], SteerChoice]) -> list[IntakeEnvelope]:
        taken: list[IntakeEnvelope] = []
        with self._write() as c:
            now = clock()
            for rid, env in _pending(c, receipt):
                choice = choose(env)
                if choice == "collapse":
                    _run(c, "finish", id=rid, state="collapsed", reason="same_message", now=now)
                elif choice == "steer" and _run(c, "steer", id=rid, job_id=receipt["job_id"], now=now) == 1:
                    _run(c, "history_insert", **history_entry(env, rid, "user"), now=now)
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
        with self._short() as c:
            inst = _one(c, "inst_get", id=inst_id)
            if inst is None:
                return RouteState(None, None, False)
            route = _one(c, "route_resolve", installation_id=inst_id, channel=channel)
            if route is None:
                return RouteState(str(inst["status"]), None, False)
            agent = _one(c, "agent_get", name=route["agent"])
            return RouteState(str(inst["status"]), str(route["agent"]), agent is not None and bool(agent["enabled"]))

    def take_slot(self, receipt: Row, *, per_agent: int, per_installation: int, ttl_s: float) -> bool:
        with self._write() as c:
            now = clock()
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
        with self._write() as c:
            _run(c, "run_release", job_id=job_id)

    def record_reply(self, receipt_id: str, reply: str, entry: Row) -> None:
        with self._write() as c:
            _run(c, "set_reply", id=receipt_id, reply=reply)
            _run(c, "history_insert", **entry, now=clock())

    def history(self, inst_id: str, conversation: str, limit: int) -> list[Row]:
        return self._read("history_recent", installation_id=inst_id, conversation=conversation, limit=limit)


def _count(c: sqlite3.Connection, name: str, /, **params: Any) -> int:
    row = _one(c, name, **params)
    return 0 if row is None else int(row["n"])


def _duplicate(c: sqlite3.Connection, row: Row, digest: str, now: float) -> Row:
    if row["body_sha256"] != digest:
        _run(c, "mismatch_insert", receipt_id=row["id"], body_sha256=digest, now=now)
        _run(c, "mismatch_bump", receipt_id=row["id"])
    return row


def _pending(c: sqlite3.Connection, receipt: Row) -> list[tuple[str, IntakeEnvelope]]:
    rows = _all(
        c,
        "newer_pending",
        installation_id=receipt["installation_id"],
        conversation=receipt["conversation"],
        job_id=receipt["job_id"],
    )
    return [(str(r["id"]), IntakeEnvelope.from_json(r["envelope"])) for r in rows if r["envelope"]]
