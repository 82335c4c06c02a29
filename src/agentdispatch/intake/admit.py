"""The one transaction of the request path: the receipt under its unique source
identity plus its WorkItem, or the original answer of a duplicate."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..stores import engine
from ..stores.base import NewJob
from .answers import Answer
from .envelope import IntakeEnvelope
from .flush import group_flush
from .store import IntakeStore, Sql

KIND = "intake_turn"
BACKLOG_PER_AGENT = 256


class Abandoned(Exception):
    """The request already answered 503: roll the transaction back."""


class BacklogFull(Exception):
    """The agent's open-item bound is reached: roll back (nothing is stored, so
    the provider's retry of the same update is new work once a slot frees)."""


@dataclass(frozen=True)
class Incoming:
    """An authenticated delivery, ready to be recorded."""

    connector: str
    source_id: str
    body: bytes
    answer: Answer
    installation: dict[str, Any] | None = None
    envelope: IntakeEnvelope | None = None
    state: str = "accepted"  # accepted | rejected | recorded
    reason: str | None = None
    conversation: str = ""
    retry_num: int = 0
    retry_reason: str | None = None

    @property
    def sha256(self) -> str:
        """Hash of the raw bytes (duplicates with other bytes are mismatches)."""
        return hashlib.sha256(self.body).hexdigest()


def job_id_of(connector: str, source_id: str) -> str:
    """The deterministic WorkItem id of one source identity."""
    return "intake-" + hashlib.sha256(f"{connector}\0{source_id}".encode()).hexdigest()[:32]


def answer_of(row: dict[str, Any]) -> Answer:
    """The stored answer of a receipt."""
    return Answer(int(row["answer_status"]), str(row["answer_type"]), str(row["answer_body"]))


def _duplicate(sql: Sql, row: dict[str, Any], digest: str, now: float) -> Answer:
    if row["body_sha256"] != digest:
        sql.run("mismatch_insert", receipt_id=row["id"], body_sha256=digest, now=now)
        sql.run("mismatch_bump", receipt_id=row["id"])
    return answer_of(row)


def _agent(sql: Sql, inst: dict[str, Any] | None, env: IntakeEnvelope | None) -> str:
    if inst is None or env is None:
        return ""
    row = sql.one("route_resolve", installation_id=inst["id"], channel=env.channel)
    return "" if row is None else str(row["agent"])


def admit(
    istore: IntakeStore,
    inc: Incoming,
    *,
    max_depth: int,
    max_attempts: int,
    rejected: Answer,
    abandoned: threading.Event,
    backlog: int = BACKLOG_PER_AGENT,
    deadline: float | None = None,
) -> Answer:
    """Record ``inc`` (and create its WorkItem) in one durable transaction;
    ``deadline`` (monotonic): when the caller stops waiting and answers 503."""
    if istore.store.name == "postgres":
        answer = _admit_pg(istore, inc, max_depth, max_attempts, abandoned, backlog, deadline)
        if answer is not None:
            return answer
    return istore.durable(lambda sql: _admit(sql, inc, max_depth, max_attempts, rejected, abandoned, backlog))


def _job(inc: Incoming, job_id: str, max_attempts: int, agent: str) -> NewJob:
    inst, env = inc.installation or {}, inc.envelope
    assert env is not None
    return NewJob(
        job_id=job_id,
        tenant=str(inst.get("tenant", "")),
        session_id=f"intake:{inst.get('id', '')}:{env.conversation}",
        kind=KIND,
        payload={"receipt": job_id},
        max_attempts=max_attempts,
        agent_name=agent,
    )


def _receipt(inc: Incoming, job_id: str | None) -> dict[str, Any]:
    """The receipt's columns (the database sets ``received_at`` and the agent)."""
    env, inst, answer = inc.envelope, inc.installation or {}, inc.answer
    return {
        "id": job_id or job_id_of(inc.connector, inc.source_id).replace("intake-", "rcpt-"),
        "connector": inc.connector,
        "source_id": inc.source_id,
        "installation_id": inst.get("id", ""),
        "tenant": inst.get("tenant", ""),
        "state": inc.state,
        "reason": inc.reason,
        "job_id": job_id,
        "conversation": env.conversation if env else inc.conversation,
        "sender": env.sender if env else "",
        "message_key": env.message_key if env else "",
        "body_sha256": inc.sha256,
        "body_size": len(inc.body),
        "envelope": env.to_json() if env else None,
        "raw": base64.b64encode(inc.body).decode(),
        "answer_status": answer.status,
        "answer_type": answer.media_type,
        "answer_body": answer.body,
        "retry_num": inc.retry_num,
        "retry_reason": inc.retry_reason,
    }


class _Planned:
    """Stands in for the connection while the engine plans a new WorkItem
    (``plan_new`` reads nothing): keeps the parameters of the write it asks for."""

    params: dict[str, Any] | None = None

    def execute(self, _query: str, params: dict[str, Any]) -> _Planned:
        self.params = params
        return self

    def fetchone(self) -> dict[str, Any]:
        return {}


ADMIT_PG = (
    "SELECT outcome, agent, answer_status, answer_type, answer_body FROM dispatch_intake_admit("
    "%(receipt)s::json, %(channel)s, %(accept)s, %(bound)s, %(max)s, %(at)s, %(items)s::json, "
    "%(events)s::json, %(queue)s::json)"
)
#: Of the time left before the 503, what the statement may take: the server
#: cancels it (and nothing commits) before the gateway gives up waiting.
STATEMENT_SHARE = 0.8


def _admit_pg(
    istore: IntakeStore,
    inc: Incoming,
    max_depth: int,
    max_attempts: int,
    abandoned: threading.Event,
    backlog: int,
    deadline: float | None,
) -> Answer | None:
    """The PostgreSQL request path: one round trip (``BEGIN``, the statement
    timeout, ``dispatch_intake_admit``, ``COMMIT`` in one message), committed
    asynchronously, then a WAL flush shared with concurrent intakes before the
    answer. None: take the general path (the id is in use without a receipt)."""
    import psycopg
    from psycopg import ClientCursor

    from ..backends.postgres.tx import PostgresTx

    store: Any = istore.store
    accept = inc.state == "accepted" and inc.envelope is not None
    job_id = job_id_of(inc.connector, inc.source_id) if accept else None
    planned = _Planned()
    if job_id is not None:
        tx = PostgresTx(planned, store._key())  # type: ignore[arg-type]
        tx.plan_new([job_id], time.time())
        engine.submit(tx, [_job(inc, job_id, max_attempts, "")], max_depth)  # agent_name: set by the route
        tx.write_new(max_depth)
    rows = planned.params or {"max": max_depth, "at": 0.0, "items": "[]", "events": "[]", "queue": "[]"}
    params = {
        **rows,
        "receipt": json.dumps(_receipt(inc, job_id)),
        "channel": inc.envelope.channel if inc.envelope is not None and inc.installation else None,
        "accept": accept,
        "bound": backlog,
    }

    def run(conn: Any) -> dict[str, Any]:
        left_ms = 60_000 if deadline is None else int((deadline - time.monotonic()) * 1000 * STATEMENT_SHARE)
        if abandoned.is_set() or left_ms < 1:
            raise Abandoned()
        text = ClientCursor(conn).mogrify(ADMIT_PG, params)
        message = f"BEGIN; SET LOCAL statement_timeout = {left_ms}; {text}; COMMIT"
        try:
            cur = conn.execute(message.encode(), prepare=False)
        except psycopg.errors.QueryCanceled:
            conn.execute("ROLLBACK")
            raise Abandoned() from None
        row = None
        while row is None:
            if cur.description is not None:
                row = cur.fetchone()
            elif not cur.nextset():
                break
        assert row is not None
        return dict(row)

    # Idempotent: run again after a lost connection, it finds the receipt.
    row = store.db.run(run, single=True, idempotent=True)
    outcome = row["outcome"]
    if outcome == "exists":
        return None
    if outcome == "backlog_full":
        raise BacklogFull(row["agent"])
    if outcome == "queue_full":
        raise engine.queue_full(max_depth, max_depth)
    # Accepted or a duplicate: answered once the receipt (ours, or the
    # original's, perhaps committed a moment ago) is on disk.
    group_flush(store.db, store.db.flush_wal).wait()
    return inc.answer if outcome == "accepted" else answer_of(row)


def _admit(
    sql: Sql,
    inc: Incoming,
    max_depth: int,
    max_attempts: int,
    rejected: Answer,
    abandoned: threading.Event,
    backlog: int,
) -> Answer:
    digest = inc.sha256
    now = sql.now()
    existing = sql.one("receipt_by_source", connector=inc.connector, source_id=inc.source_id)
    if existing is not None:
        return _duplicate(sql, existing, digest, now)
    state, reason, answer, job_id = inc.state, inc.reason, inc.answer, None
    agent = _agent(sql, inc.installation, inc.envelope)
    if state == "accepted":
        if sql.dialect == "postgres":
            queued = sql.count("backlog_admit", agent=agent, bound=backlog, job=job_id_of(inc.connector, inc.source_id))
        else:
            queued = sql.count("backlog", agent=agent)
        if queued >= backlog:
            raise BacklogFull(agent)
        job_id = job_id_of(inc.connector, inc.source_id)
    env = inc.envelope.with_receipt_time(now) if inc.envelope is not None else None
    inst = inc.installation or {}
    row = sql.one(
        "receipt_insert",
        id=job_id or job_id_of(inc.connector, inc.source_id).replace("intake-", "rcpt-"),
        connector=inc.connector,
        source_id=inc.source_id,
        installation_id=inst.get("id", ""),
        tenant=inst.get("tenant", ""),
        state=state,
        reason=reason,
        job_id=job_id,
        agent=agent,
        conversation=env.conversation if env else inc.conversation,
        sender=env.sender if env else "",
        message_key=env.message_key if env else "",
        body_sha256=digest,
        body_size=len(inc.body),
        envelope=env.to_json() if env else None,
        raw=base64.b64encode(inc.body).decode(),
        answer_status=answer.status,
        answer_type=answer.media_type,
        answer_body=answer.body,
        retry_num=inc.retry_num,
        retry_reason=inc.retry_reason,
        now=now,
    )
    if row is None:  # a concurrent copy committed first (PostgreSQL)
        existing = sql.one("receipt_by_source", connector=inc.connector, source_id=inc.source_id)
        assert existing is not None
        return _duplicate(sql, existing, digest, now)
    if job_id is not None and env is not None:
        job = NewJob(
            job_id=job_id,
            tenant=str(inst.get("tenant", "")),
            session_id=f"intake:{inst.get('id', '')}:{env.conversation}",
            kind=KIND,
            payload={"receipt": job_id},
            max_attempts=max_attempts,
            agent_name=agent,
        )
        engine.submit(sql.tx, [job], max_depth)
    if abandoned.is_set():
        raise Abandoned()
    return answer
