"""The worker-side turn kind ``intake_turn``: capture, engage, coalesce, steer,
re-resolve the route, take a capacity slot, respond, reply once."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from ..errors import NonRetryableError, Retired
from ..factory import open_intake_store
from ..handlers import Handler, Turn
from ..settings import Settings, load_settings
from . import outbound
from . import processor as p
from .base import IntakeStore
from .credentials import open_credentials
from .envelope import IntakeEnvelope

if TYPE_CHECKING:
    from ..lease import LeaseGuard

KIND = "intake_turn"
SLOT_POLL_S = 0.1
#: Replies one run sends at most (the first, then one per batch of follow-ups
#: steered in while a reply call was in flight); later ones start a new turn.
MAX_REPLIES = 8


class CapacityBusy(Exception):
    """No running-turn slot within the wait budget: retried later."""


#: What the built-in responder says, whatever the customer wrote.
ACKNOWLEDGEMENT = "Thanks, we have received your message."


def acknowledge(ctx: p.Context) -> str:
    """The built-in responder: a neutral acknowledgement. It never repeats the
    customer's words (an echo sends their text, perhaps personal data or a
    prompt injection, back out under the bot's name). Give ``build_handler``
    a responder of your own to answer for real."""
    return ACKNOWLEDGEMENT


def build_handler(
    respond: p.Respond = acknowledge,
    engage: p.Engage = p.default_engage,
    settings: Settings | None = None,
) -> Handler:
    """An ``intake_turn`` handler with a responder and an engagement policy."""

    def handle(turn: Turn, guard: LeaseGuard) -> Any:
        cfg = settings or load_settings()
        return _turn(open_intake_store(guard.store), turn, guard, cfg, respond, engage)

    return handle


def intake_turn(turn: Turn, guard: LeaseGuard) -> Any:
    """The default ``intake_turn`` (neutral acknowledgement, mentions + DMs engage)."""
    return build_handler()(turn, guard)


def _turn(
    ist: IntakeStore, turn: Turn, guard: LeaseGuard, cfg: Settings, respond: p.Respond, engage: p.Engage
) -> dict[str, Any]:
    rid = str((turn.payload or {}).get("receipt", ""))
    rec = ist.receipt(rid)
    if rec is None:
        raise NonRetryableError(f"intake receipt {rid} is missing", reason="receipt_missing")
    if rec["state"] not in ("accepted", "running"):  # settled earlier (steered, or a redelivery)
        _settled_again(rec)
        return {"disposition": rec["state"], "reason": rec["reason"]}
    phase: Literal["intake", "turn"] = "turn" if rec["captured"] else "intake"
    if ist.bump(rid, phase) > p.MAX_PHASE_ACQUISITIONS:
        why = f"{phase}_reacquisitions_exhausted"
        ist.finish(rid, "failed", why)
        raise NonRetryableError(f"intake {phase} phase reacquired too often", reason=why)
    env = IntakeEnvelope.from_json(rec["envelope"])
    if not rec["captured"]:
        engaged, collapsed = p.capture(ist, rid, env, engage)
        if collapsed or not engaged:
            state = "collapsed" if collapsed else "ignored"
            reason = "self_authored" if env.self_authored else ("same_message" if collapsed else "not_engaged")
            ist.finish(rid, state, reason)
            return {"disposition": state, "reason": reason}
    elif not rec["engaged"]:
        ist.finish(rid, "ignored", "not_engaged")
        return {"disposition": "ignored"}
    if p.age(ist, rec) > cfg.intake_stale_s:
        # Retired visibly: the WorkItem ends cancelled with reason stale, like an expired deadline.
        ist.finish(rid, "stale", "stale")
        raise Retired(f"trigger older than {cfg.intake_stale_s:g} s since receipt", reason="stale")
    newer = p.newer_trigger(ist, rec, engage)
    if newer is not None:
        ist.finish(rid, "coalesced", f"coalesced_into:{newer}")
        return {"disposition": "coalesced", "into": newer}
    rejection = p.route_rejection(ist, rec, env)
    if rejection is not None:
        ist.finish(rid, "rejected", rejection)
        raise NonRetryableError(f"route rejected: {rejection}", reason=rejection)
    _wait_for_slot(ist, rec, guard, cfg)
    try:
        return _respond(ist, rec, env, turn, guard, cfg, respond)
    finally:
        ist.release_slot(str(rec["job_id"]))


def _settled_again(rec: dict[str, Any]) -> None:
    """A redelivered turn whose receipt was retired or rejected ends the same way."""
    why = str(rec["reason"] or rec["state"])
    if rec["state"] == "stale":
        raise Retired("trigger retired as stale", reason="stale")
    if rec["state"] in ("rejected", "failed"):
        raise NonRetryableError(f"intake {rec['state']}: {why}", reason=why)


def _wait_for_slot(ist: IntakeStore, rec: dict[str, Any], guard: LeaseGuard, cfg: Settings) -> None:
    budget = time.monotonic() + max(1.0, cfg.claim_ttl_s / 2)
    while not ist.take_slot(
        rec, per_agent=cfg.mesh_max_turns_per_agent, per_installation=cfg.mesh_max_turns, ttl_s=cfg.claim_ttl_s
    ):
        guard.check()
        if time.monotonic() > budget:
            raise CapacityBusy(f"agent {rec['agent']} or its installation is at capacity")
        time.sleep(SLOT_POLL_S)


def _respond(
    ist: IntakeStore,
    rec: dict[str, Any],
    env: IntakeEnvelope,
    turn: Turn,
    guard: LeaseGuard,
    cfg: Settings,
    respond: p.Respond,
) -> dict[str, Any]:
    inst = ist.installation(str(rec["installation_id"]))
    if inst is None:
        raise NonRetryableError("installation vanished", reason="installation_vanished")
    row: dict[str, Any] = inst
    master = cfg.intake_key.get_secret_value() if cfg.intake_key else None
    ctx = p.Context(envelope=env, agent=str(rec["agent"]), history=p.history(ist, env))
    if rec["state"] == "running":  # a redelivery: what an earlier attempt steered is still ours
        ctx.steered.extend(ist.steered_into(rec))
    ctx.steered.extend(p.steer(ist, rec))
    reply, sent = respond(ctx), []
    while True:
        more = p.steer(ist, rec)  # arrived while the responder ran: joins this reply
        if more:
            ctx.steered.extend(more)
            ctx.history = p.history(ist, env)
            reply = respond(ctx)
            continue
        # The key names how many follow-ups the reply covers, so a redelivered
        # run resends nothing it already sent and still answers what it steered.
        key = f"intake-reply:{turn.job_id}:{len(ctx.steered)}"

        def send(text: str = reply, key: str = key) -> dict[str, Any]:
            return outbound.send(row, open_credentials(master, row["id"], row["credentials"]), env, text, key)

        sent.append(guard.side_effect(key, send))
        p.record_reply(ist, rec, env, reply, len(ctx.steered))
        # A follow-up that arrived while the reply call was in flight is steered
        # into this run too and answered here, not by a second turn.
        more = [] if len(sent) >= MAX_REPLIES else p.steer(ist, rec)
        if not more:
            break
        ctx.steered.extend(more)
        ctx.history = p.history(ist, env)
        reply = respond(ctx)
    ist.finish(str(rec["id"]), "replied")
    return {"disposition": "replied", "sent": sent[0], "replies": len(sent), "steered": len(ctx.steered)}
