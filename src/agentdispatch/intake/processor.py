"""Off the request path: capture, engagement, coalescing, steering, route
re-resolution and capacity slots, each one short transaction of the store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import IntakeStore, Row, history_entry, steer_choices
from .envelope import IntakeEnvelope

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


def capture(istore: IntakeStore, receipt_id: str, env: IntakeEnvelope, engage: Engage) -> tuple[bool, bool]:
    """Record the message in history; ``(engaged, collapsed)``. A second event
    of the same message (Slack's app_mention/message pair) collapses."""
    role = "self" if env.self_authored else "user"
    wants = engage(env)
    collapsed = istore.capture(receipt_id, history_entry(env, receipt_id, role), engage=wants)
    return (not collapsed) and wants, collapsed


def age(istore: IntakeStore, receipt: Row) -> float:
    """Seconds since durable receipt, by the database clock."""
    return istore.now() - float(receipt["received_at"])


def newer_trigger(istore: IntakeStore, receipt: Row, engage: Engage) -> str | None:
    """The newest later receipt of the conversation that will engage (coalescing)."""
    # Another event of the same message (app_mention + message) collapses instead.
    found = [
        rid for rid, env in istore.newer_pending(receipt) if env.message_key != receipt["message_key"] and engage(env)
    ]
    return found[-1] if found else None


def steer(istore: IntakeStore, receipt: Row) -> list[IntakeEnvelope]:
    """Move later messages of the same requester into this run (captured here)."""
    return istore.steer(receipt, steer_choices(receipt))


def route_rejection(istore: IntakeStore, receipt: Row, env: IntakeEnvelope) -> str | None:
    """Why the current route forbids this turn, or None when it may run."""
    route = istore.route_state(str(receipt["installation_id"]), env.channel)
    if route.status != "active":
        return "installation_stopped"
    if route.agent is None:
        return "missing_route"
    if route.agent != receipt["agent"]:
        return "route_reassigned"
    if not route.enabled:
        return "agent_disabled"
    return None


def record_reply(istore: IntakeStore, receipt: Row, env: IntakeEnvelope, reply: str, steered: int) -> None:
    """Keep the reply (voice answers it from here) and add it to the history;
    ``steered`` (the follow-ups it covers) tells a run's replies apart."""
    key = f"reply:{receipt['job_id']}" + (f":{steered}" if steered else "")
    entry = history_entry(env, str(receipt["id"]), "agent", key=key, sender=str(receipt["agent"]), text=reply)
    istore.record_reply(str(receipt["id"]), reply, entry)


def history(istore: IntakeStore, env: IntakeEnvelope, limit: int = 20) -> list[Row]:
    """Recent history of the conversation, oldest first."""
    return list(reversed(istore.history(env.installation, env.conversation, limit)))
