"""Off the request path: capture, engagement, coalescing, steering, route
re-resolution and capacity slots, each one short transaction of the store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .envelope import IntakeEnvelope
from .store import IntakeStore, Sql

#: The first acquisition of a phase plus up to three reacquisitions.
MAX_PHASE_ACQUISITIONS = 4

Engage = Callable[[IntakeEnvelope], bool]


def default_engage(env: IntakeEnvelope) -> bool:
    """Mentions and direct messages engage; the bot's own words never do."""
    return not env.self_authored and (env.mentions_bot or env.is_dm)


@dataclass
class Context:
    """What a responder sees: the trigger, steered follow-ups and recent history."""

    envelope: IntakeEnvelope
    agent: str
    history: list[dict[str, Any]] = field(default_factory=list)
    steered: list[IntakeEnvelope] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        """The trigger's text followed by every steered follow-up's."""
        return [self.envelope.text, *(e.text for e in self.steered)]


Respond = Callable[[Context], str]


def _history_row(sql: Sql, env: IntakeEnvelope, receipt_id: str, role: str) -> int:
    return sql.run(
        "history_insert",
        installation_id=env.installation,
        conversation=env.conversation,
        message_key=env.message_key or receipt_id,
        receipt_id=receipt_id,
        role=role,
        sender=env.sender,
        text=env.text,
        now=sql.now(),
    )


def bump(istore: IntakeStore, receipt_id: str, phase: str) -> int:
    """Count one acquisition of ``phase`` (``intake`` or ``turn``); returns the total."""
    with istore.tx() as sql:
        n = sql.count("bump_intake" if phase == "intake" else "bump_turn", id=receipt_id)
        # Mirrored on the WorkItem (its id is the receipt's) for the operators' SQL.
        sql.run("mirror_intake" if phase == "intake" else "mirror_turn", id=receipt_id, n=n)
        return n


def capture(istore: IntakeStore, receipt_id: str, env: IntakeEnvelope, engage: Engage) -> tuple[bool, bool]:
    """Record the message in history; ``(engaged, collapsed)``. A second event
    of the same message (Slack's app_mention/message pair) collapses."""
    with istore.tx() as sql:
        role = "self" if env.self_authored else "user"
        collapsed = _history_row(sql, env, receipt_id, role) == 0
        engaged = (not collapsed) and engage(env)
        sql.run("mark_captured", id=receipt_id, engaged=1 if engaged else 0)
        return engaged, collapsed


def finish(istore: IntakeStore, receipt_id: str, state: str, reason: str | None = None) -> None:
    """Close a receipt with a visible state and reason."""
    with istore.tx() as sql:
        sql.run("finish", id=receipt_id, state=state, reason=reason, now=sql.now())


def age(istore: IntakeStore, receipt: dict[str, Any]) -> float:
    """Seconds since durable receipt, by the database clock."""
    with istore.tx(durable=False) as sql:
        return sql.now() - float(receipt["received_at"])


def _pending(sql: Sql, receipt: dict[str, Any]) -> list[tuple[str, IntakeEnvelope]]:
    rows = sql.all(
        "newer_pending",
        installation_id=receipt["installation_id"],
        conversation=receipt["conversation"],
        job_id=receipt["job_id"],
    )
    return [(str(r["id"]), IntakeEnvelope.from_json(r["envelope"])) for r in rows if r["envelope"]]


def newer_trigger(istore: IntakeStore, receipt: dict[str, Any], engage: Engage) -> str | None:
    """The newest later receipt of the conversation that will engage (coalescing)."""
    with istore.tx(durable=False) as sql:
        # Another event of the same message (app_mention + message) collapses instead.
        found = [
            rid for rid, env in _pending(sql, receipt) if env.message_key != receipt["message_key"] and engage(env)
        ]
    return found[-1] if found else None


def steer(istore: IntakeStore, receipt: dict[str, Any]) -> list[IntakeEnvelope]:
    """Move later messages of the same requester into this run (captured here)."""
    taken: list[IntakeEnvelope] = []
    with istore.tx() as sql:
        for rid, env in _pending(sql, receipt):
            if env.message_key == receipt["message_key"]:  # the other event of this very message
                sql.run("finish", id=rid, state="collapsed", reason="same_message", now=sql.now())
                continue
            same = env.sender == receipt["sender"] and not env.self_authored
            if same and sql.run("steer", id=rid, job_id=receipt["job_id"], now=sql.now()) == 1:
                _history_row(sql, env, rid, "user")
                taken.append(env)
    return taken


def steered_into(istore: IntakeStore, receipt: dict[str, Any]) -> list[IntakeEnvelope]:
    """The follow-ups already steered into this run (by an earlier attempt), in order."""
    rows = istore.read(
        "steered_of",
        installation_id=receipt["installation_id"],
        conversation=receipt["conversation"],
        job_id=receipt["job_id"],
    )
    return [IntakeEnvelope.from_json(r["envelope"]) for r in rows if r["envelope"]]


def route_rejection(istore: IntakeStore, receipt: dict[str, Any], env: IntakeEnvelope) -> str | None:
    """Why the current route forbids this turn, or None when it may run."""
    with istore.tx(durable=False) as sql:
        inst = sql.one("inst_get", id=receipt["installation_id"])
        if inst is None or inst["status"] != "active":
            return "installation_stopped"
        route = sql.one("route_resolve", installation_id=inst["id"], channel=env.channel)
        if route is None:
            return "missing_route"
        if route["agent"] != receipt["agent"]:
            return "route_reassigned"
        agent = sql.one("agent_get", name=route["agent"])
        if agent is None or not agent["enabled"]:
            return "agent_disabled"
    return None


def installation(istore: IntakeStore, inst_id: str) -> dict[str, Any] | None:
    """One installation row (with its stored credentials)."""
    rows = istore.read("inst_get", id=inst_id)
    return rows[0] if rows else None


def take_slot(
    istore: IntakeStore, receipt: dict[str, Any], *, per_agent: int, per_installation: int, ttl_s: float
) -> bool:
    """Claim a running-turn slot within both capacity bounds (or renew ours)."""
    with istore.tx() as sql:
        if sql.dialect == "postgres":  # one order for every process: agent, then installation
            sql.one("agent_lock", key=f"intake-run:{receipt['agent']}")
            sql.one("agent_lock", key=f"intake-inst:{receipt['installation_id']}")
        now = sql.now()
        mine = {"job_id": receipt["job_id"], "now": now}
        if sql.count("runs_of_agent", agent=receipt["agent"], **mine) >= per_agent:
            return False
        if sql.count("runs_of_installation", installation_id=receipt["installation_id"], **mine) >= per_installation:
            return False
        sql.run(
            "run_upsert",
            job_id=receipt["job_id"],
            agent=receipt["agent"],
            installation_id=receipt["installation_id"],
            conversation=receipt["conversation"],
            requester=receipt["sender"],
            now=now,
            expires_at=now + ttl_s,
        )
        sql.run("set_running", id=receipt["id"])
        return True


def release_slot(istore: IntakeStore, job_id: str) -> None:
    """Free the running-turn slot."""
    with istore.tx() as sql:
        sql.run("run_release", job_id=job_id)


def record_reply(istore: IntakeStore, receipt: dict[str, Any], env: IntakeEnvelope, reply: str, steered: int) -> None:
    """Keep the reply (voice answers it from here) and add it to the history;
    ``steered`` (the follow-ups it covers) tells a run's replies apart."""
    with istore.tx() as sql:
        sql.run("set_reply", id=receipt["id"], reply=reply)
        sql.run(
            "history_insert",
            installation_id=env.installation,
            conversation=env.conversation,
            message_key=f"reply:{receipt['job_id']}" + (f":{steered}" if steered else ""),
            receipt_id=receipt["id"],
            role="agent",
            sender=receipt["agent"],
            text=reply,
            now=sql.now(),
        )


def history(istore: IntakeStore, env: IntakeEnvelope, limit: int = 20) -> list[dict[str, Any]]:
    """Recent history of the conversation, oldest first."""
    rows = istore.read("history_recent", installation_id=env.installation, conversation=env.conversation, limit=limit)
    return list(reversed(rows))
