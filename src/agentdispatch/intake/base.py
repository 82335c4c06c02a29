"""The intake seam: what durable intake needs from the database.

One implementation per database backend (``backends/sqlite/intake.py``,
``backends/postgres/intake.py``), each with its own SQL; only the factory
names them (:func:`agentdispatch.factory.open_intake_store`). Rows are plain
dicts of the intake tables' columns (``backends/*/sql/schema.sql``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..stores.base import Accepted, NewJob
from .envelope import IntakeEnvelope

Row = dict[str, Any]
#: What :meth:`IntakeStore.steer` does with a later message of the conversation.
SteerChoice = Literal["collapse", "steer", "leave"]


class Abandoned(Exception):
    """The request already answered 503: roll the transaction back."""


class BacklogFull(Exception):
    """The agent's open-item bound is reached: roll back. The refusal is then
    recorded on its own (:meth:`IntakeStore.refuse`), and the provider's retry
    of the same update replaces it: new work once a slot frees."""


@dataclass(frozen=True)
class Admission:
    """One delivery to record: the receipt's columns (the store sets the agent
    from the route and ``received_at`` from its clock, also in the envelope)
    and, for an accepted one, its WorkItem (the store sets ``agent_name``)."""

    receipt: Row
    #: The channel whose route names the agent (None: no agent).
    channel: str | None
    #: The agent's open-item bound.
    backlog: int
    #: The queue's bound (``AGENT_DISPATCH_MAX_DEPTH``).
    max_depth: int
    job: NewJob | None = None
    #: Set when the caller stopped waiting (answered 503): roll back.
    abandoned: threading.Event | None = None
    #: Monotonic time when the caller stops waiting, if any.
    deadline: float | None = None


@dataclass(frozen=True)
class Admitted:
    """What recording a delivery did: the WorkItem it created (empty for a
    delivery without one), or the stored receipt of an earlier copy."""

    accepted: list[Accepted]
    original: Row | None = None


@dataclass(frozen=True)
class RouteState:
    """What the current route of a channel says: the installation's status
    (None: no installation), the agent routed to (None: no route) and whether
    that agent is enabled."""

    status: str | None
    agent: str | None
    enabled: bool


class IntakeStore(Protocol):
    """Intake tables, each verb one transaction of the WorkItem store's database."""

    # -- the request path ------------------------------------------------------
    def admit(self, a: Admission) -> Admitted:
        """Record the receipt under its unique source identity and create its
        WorkItem (``a.job``) in one durable transaction, or answer with the
        receipt of an earlier copy (a mismatched body is counted on it).
        Raises :class:`BacklogFull`, :class:`QueueFull` or :class:`Abandoned`
        with nothing written."""

    def refuse(self, receipt: Row) -> None:
        """Record a delivery refused for a full backlog: ``receipt`` (state
        ``rejected``, reason ``backlog_full``, no WorkItem) in a transaction of
        its own; nothing when a receipt of that source exists by now."""

    def forget_refusal(self, connector: str, source_id: str) -> bool:
        """Delete the refused receipt of one source identity (its retry is
        admitted afresh); False when it has none (another copy took it)."""

    def installations(self, connector: str, route_key: str) -> list[Row]:
        """The installations of a route key (a Slack app, a bot, an account)."""

    def receipt_by_source(self, connector: str, source_id: str) -> Row | None:
        """The receipt of one source identity."""

    # -- administration --------------------------------------------------------
    def install(self, row: Row) -> None:
        """Create or update an installation (``row``: its columns but times)."""

    def set_installation_status(self, inst_id: str, status: str) -> bool:
        """Stop or restart an installation; False when unknown."""

    def set_agent(self, name: str, *, enabled: bool) -> None:
        """Create an agent or change whether it is enabled."""

    def set_route(self, inst_id: str, channel: str, agent: str | None) -> None:
        """Route a channel to an agent; None removes the route."""

    def listing(self, what: Literal["installations", "agents", "routes", "receipts"]) -> list[Row]:
        """Installations (without credentials), agents, routes, or receipts per state."""

    def scrub(self, age_s: float) -> int:
        """Clear the bodies of terminal receipts older than ``age_s``; identities stay."""

    # -- the worker-side turn --------------------------------------------------
    def now(self) -> float:
        """Database time."""

    def installation(self, inst_id: str) -> Row | None:
        """One installation (with its stored credentials)."""

    def receipt(self, receipt_id: str) -> Row | None:
        """One receipt."""

    def bump(self, receipt_id: str, phase: Literal["intake", "turn"]) -> int:
        """Count one acquisition of ``phase``; returns the total (mirrored on the WorkItem)."""

    def capture(self, receipt_id: str, entry: Row, *, engage: bool) -> bool:
        """Add the message to the conversation's history (``entry``: its
        columns but ``at``) and mark the receipt captured, engaged when
        ``engage`` and the message is new; True when it was there already
        (another event of the same message: collapsed)."""

    def finish(self, receipt_id: str, state: str, reason: str | None = None) -> None:
        """Close an open receipt with a visible state and reason."""

    def newer_pending(self, receipt: Row) -> list[tuple[str, IntakeEnvelope]]:
        """Later accepted receipts of the receipt's conversation, oldest first."""

    def steer(self, receipt: Row, choose: Callable[[IntakeEnvelope], SteerChoice]) -> list[IntakeEnvelope]:
        """In one transaction, for each later accepted receipt of the
        conversation: collapse it, steer it into this run (its message joins
        the history), or leave it; returns the envelopes steered."""

    def steered_into(self, receipt: Row) -> list[IntakeEnvelope]:
        """The follow-ups steered into this receipt's run, in order."""

    def route_state(self, inst_id: str, channel: str) -> RouteState:
        """The installation's status and the channel's current route."""

    def take_slot(self, receipt: Row, *, per_agent: int, per_installation: int, ttl_s: float) -> bool:
        """Claim a running-turn slot within both bounds (or renew ours) and
        mark the receipt running; False when either bound is reached."""

    def release_slot(self, job_id: str) -> None:
        """Free the running-turn slot."""

    def record_reply(self, receipt_id: str, reply: str, entry: Row) -> None:
        """Keep the reply on the receipt and add it to the history (``entry``)."""

    def history(self, inst_id: str, conversation: str, limit: int) -> list[Row]:
        """The newest ``limit`` messages of a conversation, newest first."""


def steer_choices(receipt: Row) -> Callable[[IntakeEnvelope], SteerChoice]:
    """The steering rule: another event of the same message collapses; a later
    message of the same requester (not the bot) is steered into this run."""

    def choose(env: IntakeEnvelope) -> SteerChoice:
        if env.message_key == receipt["message_key"]:
            return "collapse"
        if env.sender == receipt["sender"] and not env.self_authored:
            return "steer"
        return "leave"

    return choose


def history_entry(
    env: IntakeEnvelope,
    receipt_id: str,
    role: str,
    *,
    key: str | None = None,
    sender: str | None = None,
    text: str | None = None,
) -> Row:
    """A history row of the envelope's conversation (``at``: set by the store);
    by default the envelope's message, sender and text."""
    return {
        "installation_id": env.installation,
        "conversation": env.conversation,
        "message_key": key if key is not None else (env.message_key or receipt_id),
        "receipt_id": receipt_id,
        "role": role,
        "sender": env.sender if sender is None else sender,
        "text": env.text if text is None else text,
    }
