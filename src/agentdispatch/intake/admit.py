"""The one transaction of the request path: the receipt under its unique source
identity plus its WorkItem, submitted through the Dispatcher, or the original
answer of a duplicate."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..dispatch import Dispatcher, Submission
from ..stores.base import Accepted, NewJob
from .answers import Answer
from .base import Abandoned, Admission, Admitted, BacklogFull, IntakeStore, Row
from .envelope import IntakeEnvelope

log = logging.getLogger(__name__)

KIND = "intake_turn"
BACKLOG_PER_AGENT = 256
#: The reason of a receipt refused for a full backlog, and its stored answer.
BACKLOG_FULL = "backlog_full"
REFUSED = Answer(503, "application/json", json.dumps({"status": "error", "error": BACKLOG_FULL}))
#: What a session id may hold (the Dispatcher's identifier rule).
_SESSION_SAFE = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,200}$")

__all__ = ["BACKLOG_FULL", "Abandoned", "BacklogFull", "Incoming", "admit", "answer_of", "job_id_of", "refused"]


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


def answer_of(row: Row) -> Answer:
    """The stored answer of a receipt."""
    return Answer(int(row["answer_status"]), str(row["answer_type"]), str(row["answer_body"]))


def admit(
    istore: IntakeStore,
    dispatcher: Dispatcher,
    inc: Incoming,
    *,
    abandoned: threading.Event,
    backlog: int = BACKLOG_PER_AGENT,
    deadline: float | None = None,
) -> Answer:
    """Record ``inc`` and submit its WorkItem through ``dispatcher``, in one
    durable transaction of ``istore``; ``deadline`` (monotonic): when the
    caller stops waiting and answers 503."""
    env, inst = inc.envelope, inc.installation
    accept = inc.state == "accepted" and env is not None
    job_id = job_id_of(inc.connector, inc.source_id) if accept else None
    admission = Admission(
        receipt=_receipt(inc, job_id),
        channel=env.channel if env is not None and inst else None,
        backlog=backlog,
        max_depth=dispatcher.settings.max_depth,
        abandoned=abandoned,
        deadline=deadline,
    )
    if job_id is None or env is None:  # nothing to run: the receipt alone
        return _answer(inc, istore.admit(admission))

    def record() -> Admitted:
        done: list[Admitted] = []

        def write(jobs: Sequence[NewJob], /, *, max_depth: int) -> list[Accepted]:
            # The store sets the job's agent from the route it reads in this transaction.
            done.append(istore.admit(dataclasses.replace(admission, job=jobs[0], max_depth=max_depth)))
            return done[-1].accepted

        dispatcher.submit_many([_submission(inc, env, job_id)], write=write)
        return done[-1]

    try:
        admitted = record()
        if refused(admitted.original) and istore.forget_refusal(inc.connector, inc.source_id):
            # The provider's retry of a delivery refused for a full backlog: new work.
            admitted = record()
    except BacklogFull as full:
        try:
            istore.refuse(_refusal(admission.receipt, str(full.args[0]) if full.args else ""))
        except Exception as exc:  # the record is for operators: the answer is 503 either way
            log.warning("intake: could not record a refusal for a full backlog: %s", exc)
        raise
    original = admitted.original
    if original is not None and refused(original):  # another copy was refused meanwhile
        raise BacklogFull(str(original["agent"]))
    return _answer(inc, admitted)


def refused(row: Row | None) -> bool:
    """Whether a stored receipt may be a refusal for a full backlog (its
    answer asked the provider to retry): a retry is then no duplicate."""
    return row is not None and int(row["answer_status"]) == REFUSED.status


def _refusal(receipt: Row, agent: str) -> Row:
    """The rejected receipt that records a refusal for a full backlog."""
    return {
        **receipt,
        "agent": agent,
        "state": "rejected",
        "reason": BACKLOG_FULL,
        "job_id": None,
        "answer_status": REFUSED.status,
        "answer_type": REFUSED.media_type,
        "answer_body": REFUSED.body,
    }


def _answer(inc: Incoming, admitted: Admitted) -> Answer:
    return inc.answer if admitted.original is None else answer_of(admitted.original)


def _submission(inc: Incoming, env: IntakeEnvelope, job_id: str) -> Submission:
    inst = inc.installation or {}
    session = f"intake:{inst.get('id', '')}:{env.conversation}"
    if not _SESSION_SAFE.match(session):  # a provider's odd conversation id: still one session
        session = "intake:" + hashlib.sha256(session.encode()).hexdigest()[:32]
    return Submission(
        kind=KIND,
        payload={"receipt": job_id},
        tenant=str(inst.get("tenant", "")),
        session_id=session,
        job_id=job_id,
    )


def _receipt(inc: Incoming, job_id: str | None) -> Row:
    """The receipt's columns (the store sets ``received_at`` and the agent)."""
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
