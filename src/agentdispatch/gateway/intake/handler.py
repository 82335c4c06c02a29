"""The worker-side turn kind ``intake_turn``: capture, engage, coalesce, steer,
re-resolve the route, take a capacity slot, respond, reply once."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...errors import NonRetryableError
from ...handlers import Handler, Turn
from ...settings import Settings, load_settings
from . import outbound
from . import processor as p
from .credentials import open_credentials
from .envelope import IntakeEnvelope
from .store import IntakeStore

if TYPE_CHECKING:
    from ...lease import LeaseGuard

KIND = "intake_turn"
SLOT_POLL_S = 0.1


class CapacityBusy(Exception):
    """No running-turn slot within the wait budget: retried later."""


def echo_responder(ctx: p.Context) -> str:
    """The built-in responder: acknowledges what it was asked (demos, tests)."""
    return "received: " + " / ".join(ctx.texts)


def build_handler(
    respond: p.Respond = echo_responder,
    engage: p.Engage = p.default_engage,
    settings: Settings | None = None,
) -> Handler:
    """An ``intake_turn`` handler with a responder and an engagement policy."""

    def handle(turn: Turn, guard: LeaseGuard) -> Any:
        cfg = settings or load_settings()
        return _turn(IntakeStore(guard.store), turn, guard, cfg, respond, engage)

    return handle


def intake_turn(turn: Turn, guard: LeaseGuard) -> Any:
    """The default ``intake_turn`` (echo responder, mentions + DMs engage)."""
    return build_handler()(turn, guard)


def _turn(
    ist: IntakeStore, turn: Turn, guard: LeaseGuard, cfg: Settings, respond: p.Respond, engage: p.Engage
) -> dict[str, Any]:
    rid = str((turn.payload or {}).get("receipt", ""))
    rec = ist.receipt(rid)
    if rec is None:
        raise NonRetryableError(f"intake receipt {rid} is missing")
    if rec["state"] not in ("accepted", "running"):
        return {"disposition": rec["state"], "reason": rec["reason"]}  # settled earlier (steered, redelivery)
    phase = "turn" if rec["captured"] else "intake"
    if p.bump(ist, rid, phase) > p.MAX_PHASE_ACQUISITIONS:
        p.finish(ist, rid, "failed", f"{phase}_reacquisitions_exhausted")
        raise NonRetryableError(f"intake {phase} phase reacquired too often")
    env = IntakeEnvelope.from_json(rec["envelope"])
    if not rec["captured"]:
        engaged, collapsed = p.capture(ist, rid, env, engage)
        if collapsed or not engaged:
            state = "collapsed" if collapsed else "ignored"
            reason = "self_authored" if env.self_authored else ("same_message" if collapsed else "not_engaged")
            p.finish(ist, rid, state, reason)
            return {"disposition": state, "reason": reason}
    elif not rec["engaged"]:
        p.finish(ist, rid, "ignored", "not_engaged")
        return {"disposition": "ignored"}
    if p.age(ist, rec) > p.STALE_S:
        p.finish(ist, rid, "stale", "stale")
        return {"disposition": "stale", "reason": "stale"}
    newer = p.newer_trigger(ist, rec, engage)
    if newer is not None:
        p.finish(ist, rid, "coalesced", f"coalesced_into:{newer}")
        return {"disposition": "coalesced", "into": newer}
    why = p.route_rejection(ist, rec, env)
    if why is not None:
        p.finish(ist, rid, "rejected", why)
        raise NonRetryableError(f"route rejected: {why}")
    _wait_for_slot(ist, rec, guard, cfg)
    try:
        return _respond(ist, rec, env, turn, guard, cfg, respond)
    finally:
        p.release_slot(ist, str(rec["job_id"]))


def _wait_for_slot(ist: IntakeStore, rec: dict[str, Any], guard: LeaseGuard, cfg: Settings) -> None:
    budget = time.monotonic() + max(1.0, cfg.claim_ttl_s / 2)
    while not p.take_slot(
        ist, rec, per_agent=cfg.mesh_max_turns_per_agent, per_installation=cfg.mesh_max_turns, ttl_s=cfg.claim_ttl_s
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
    ctx = p.Context(envelope=env, agent=str(rec["agent"]), history=p.history(ist, env))
    ctx.steered.extend(p.steer(ist, rec))
    reply = respond(ctx)
    # Follow-ups that arrived while the responder ran join this run too.
    more = p.steer(ist, rec)
    if more:
        ctx.steered.extend(more)
        ctx.history = p.history(ist, env)
        reply = respond(ctx)
    inst = p.installation(ist, str(rec["installation_id"]))
    if inst is None:
        raise NonRetryableError("installation vanished")
    key = f"intake-reply:{turn.job_id}:0"
    master = cfg.intake_key.get_secret_value() if cfg.intake_key else None

    def send() -> dict[str, Any]:
        return outbound.send(inst, open_credentials(master, inst["id"], inst["credentials"]), env, reply, key)

    sent = guard.side_effect(key, send)
    p.record_reply(ist, rec, env, reply)
    return {"disposition": "replied", "sent": sent, "steered": len(ctx.steered)}
