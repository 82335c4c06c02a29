"""Handlers for the multi-process crash tests: they log what they do to a
per-process sink so the test can prove no loss, no duplicate effects and no
session overlap after SIGKILLs."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import NOT_HAPPENED, LeaseGuard

registry = Registry()


def _sink(kind: str, *fields: object) -> None:
    path = Path(os.environ["CRASH_SINK_DIR"]) / f"{os.getpid()}.log"
    line = " ".join([kind, str(os.getpid()), *map(str, fields), repr(time.time())]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@registry.register("crash_turn")
def crash_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    """Work a little, send one recorded effect, work a little more."""
    _sink("start", turn.session_id, turn.job_id, turn.payload["i"])
    try:
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
        guard.side_effect(f"effect:{turn.job_id}", lambda: _sink("effect", turn.job_id))
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
    finally:
        # Also when the turn raises (EffectUnknown, LeaseLost): it stopped here.
        _sink("end", turn.session_id, turn.job_id, turn.payload["i"])
    return {"pid": os.getpid()}


@registry.register("slow_effect")
def slow_effect(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    """Sleep (in wall-clock steps), then one effect: the zombie test pauses us."""
    _sink("start", turn.session_id, turn.job_id, 0)
    try:
        end = time.time() + float(turn.payload["seconds"])
        while time.time() < end:
            time.sleep(0.05)
        guard.side_effect(f"effect:{turn.job_id}", lambda: _sink("effect", turn.job_id))
    finally:
        _sink("end", turn.session_id, turn.job_id, 0)
    return {"pid": os.getpid()}


def _sent(job_id: str) -> bool:
    """The downstream's own answer: does its log hold the effect of ``job_id``?"""
    for log in Path(os.environ["CRASH_SINK_DIR"]).glob("*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if parts[0] == "effect" and parts[2] == job_id:
                return True
    return False


@registry.register("verify_turn")
def verify_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    """:func:`crash_turn` with an effect the downstream can be asked about."""
    _sink("start", turn.session_id, turn.job_id, turn.payload["i"])
    try:
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
        guard.side_effect(
            f"effect:{turn.job_id}",
            lambda: _sink("effect", turn.job_id),
            verify=lambda: None if _sent(turn.job_id) else NOT_HAPPENED,
        )
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
    finally:
        _sink("end", turn.session_id, turn.job_id, turn.payload["i"])
    return {"pid": os.getpid()}


def _send_once(key: str, job_id: str) -> None:
    """A downstream that deduplicates by idempotency key: the first send with
    ``key`` takes effect, a repeat answers the same and changes nothing. The
    record of the send and the key are one file, linked into place in one step,
    so a kill at any point leaves either both or neither."""
    sink = Path(os.environ["CRASH_SINK_DIR"])
    name = key.replace(":", "_")
    draft = sink / f".{name}.{os.getpid()}.draft"
    draft.write_text(f"effect {os.getpid()} {job_id} {time.time()!r}\n")
    try:
        os.link(draft, sink / f"sent-{name}.log")
    except FileExistsError:
        pass
    finally:
        draft.unlink()


@registry.register("idempotent_turn")
def idempotent_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    """:func:`crash_turn` with an effect its downstream deduplicates by key."""
    _sink("start", turn.session_id, turn.job_id, turn.payload["i"])
    try:
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
        key = f"effect:{turn.job_id}"
        guard.side_effect(key, lambda: _send_once(key, turn.job_id), idempotent=True)
        time.sleep(random.uniform(0.0, float(turn.payload.get("max_sleep", 0.03))))
    finally:
        _sink("end", turn.session_id, turn.job_id, turn.payload["i"])
    return {"pid": os.getpid()}


@registry.register("checkpoint_turn")
def checkpoint_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    """Steps of work, each saved by a checkpoint: a killed turn's next attempt
    starts after the last step its checkpoint holds."""
    state = turn.checkpoint or {"done": []}
    first = len(state["done"])
    _sink("resume", turn.job_id, turn.attempt, first)
    for step in range(first, int(turn.payload["steps"])):
        time.sleep(float(turn.payload["step_s"]))
        _sink("step", turn.job_id, step)
        state = {"done": [*state["done"], step]}
        guard.checkpoint(state)
    return state
