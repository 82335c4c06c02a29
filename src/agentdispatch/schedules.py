"""Periodic schedules: a cron expression (croniter) that fires one job per tick.

Every worker (beside its reconciler) and every gateway runs a firer. Each pass
reads the running schedules whose next tick is due (by the store's clock) and,
for each, submits the job of the *latest* due tick, then moves the schedule on
to its first tick after now. The job id derives from the schedule and the tick,
so firers racing on one tick submit the same job (one row, however many
firers); moving on is a compare-and-set, so a slower firer does not move the
schedule back. Ticks missed while nothing ran (an outage) fire once, as that
latest tick, not once each.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from .dispatch import Dispatcher, Submission, validate
from .errors import AgentDispatchError, IdempotencyConflict, InvalidInput, QueueFull
from .stores.base import Schedule

log = logging.getLogger("agentdispatch.schedules")

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
#: How often a firer looks for due schedules (a cheap indexed read).
FIRE_EVERY_S = 1.0


class ScheduleNotFound(AgentDispatchError):
    """No such schedule for this tenant."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Schedule {name} not found")
        self.name = name


class ScheduleExists(InvalidInput):
    """A schedule of that name exists already (delete it first)."""


def _zone(tz: str) -> ZoneInfo:
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput(f"unknown time zone {tz!r} (an IANA name like Europe/Berlin)") from None


def check_cron(cron: str) -> str:
    """A valid cron expression (5 fields, or 6 with seconds last), or :class:`InvalidInput`."""
    if not isinstance(cron, str) or len(cron) > 200 or not croniter.is_valid(cron):
        raise InvalidInput(f"invalid cron expression {cron!r} (like '*/5 * * * *')")
    fields = cron.split()
    # croniter also takes a 7th field, a year: such a schedule runs out of
    # ticks, and a schedule without a next tick cannot be advanced.
    if not (len(fields) in (5, 6) or (len(fields) == 1 and fields[0].startswith("@"))):
        raise InvalidInput(f"cron expression {cron!r} must have 5 fields, or 6 with seconds last")
    return cron


def next_tick(cron: str, tz: str, after: float) -> float:
    """The first tick of ``cron`` in ``tz`` strictly after ``after`` (unix
    time); :class:`InvalidInput` when there is none (February 30th)."""
    try:
        return float(croniter(cron, datetime.fromtimestamp(after, _zone(tz))).get_next(float))
    except CroniterBadDateError:
        raise InvalidInput(f"cron expression {cron!r} never fires after {after:.0f}") from None


def latest_tick(cron: str, tz: str, now: float) -> tuple[float, float]:
    """``(tick, next)``: the latest tick at or before ``now`` and the first after it."""
    zone = _zone(tz)
    following = next_tick(cron, tz, now)
    tick = float(croniter(cron, datetime.fromtimestamp(following, zone)).get_prev(float))
    return tick, following


def tick_job_id(schedule: Schedule, tick: float) -> str:
    """The id of the job a schedule fires at ``tick``: the same for every firer
    (a schedule re-created under the same name makes new ids: its creation
    time is part of it)."""
    key = f"{schedule.tenant}\x1f{schedule.name}\x1f{schedule.created_at!r}\x1f{tick!r}"
    return "sched-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _submission(s: Schedule, job_id: str | None = None) -> Submission:
    return Submission(
        kind=s.kind,
        payload=s.payload,
        tenant=s.tenant,
        session_id=s.session_id,
        priority=s.priority,
        agent_name=s.agent_name,
        job_id=job_id,
    )


class Schedules:
    """Add, list, pause, resume, delete and fire schedules over a dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    def add(
        self,
        tenant: str,
        name: str,
        *,
        cron: str,
        kind: str,
        payload: Any = None,
        tz: str = "UTC",
        session_id: str | None = None,
        priority: int = 0,
        agent_name: str = "",
        paused: bool = False,
    ) -> dict[str, Any]:
        """Store a new schedule (raises :class:`ScheduleExists` for a taken name)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidInput("schedule name must be 1-100 characters of letters, digits and _.:-")
        check_cron(cron)
        sched = Schedule(
            tenant=tenant,
            name=name,
            cron=cron,
            tz=tz,
            kind=kind,
            payload=payload,
            next_at=next_tick(cron, tz, time.time()),
            session_id=session_id,
            priority=priority,
            agent_name=agent_name,
            paused=paused,
        )
        # The jobs it will submit must be valid now, not fail at every tick.
        validate(_submission(sched), max_attempts=1, known_kinds=self.d.known_kinds)
        if not self.d.store.schedule_add(sched):
            raise ScheduleExists(f"schedule {name} exists already; delete it first")
        return self.get(tenant, name)

    def entries(self, tenant: str | None) -> list[dict[str, Any]]:
        """The tenant's schedules by name."""
        return [s.view() for s in self.d.store.schedules(tenant)]

    def get(self, tenant: str, name: str) -> dict[str, Any]:
        """One schedule's view (raises :class:`ScheduleNotFound`)."""
        return self._get(tenant, name).view()

    def _get(self, tenant: str, name: str) -> Schedule:
        for s in self.d.store.schedules(tenant):
            if s.name == name:
                return s
        raise ScheduleNotFound(name)

    def pause(self, tenant: str, name: str) -> dict[str, Any]:
        """Stop firing until resumed."""
        s = self._get(tenant, name)
        self.d.store.schedule_update(tenant, name, paused=True, next_at=s.next_at)
        return self.get(tenant, name)

    def resume(self, tenant: str, name: str) -> dict[str, Any]:
        """Fire again from the first tick after now (ticks while paused do not fire)."""
        s = self._get(tenant, name)
        self.d.store.schedule_update(tenant, name, paused=False, next_at=next_tick(s.cron, s.tz, time.time()))
        return self.get(tenant, name)

    def delete(self, tenant: str, name: str) -> dict[str, Any]:
        """Delete a schedule (jobs it fired stay)."""
        view = self.get(tenant, name)
        if not self.d.store.schedule_delete(tenant, name):
            raise ScheduleNotFound(name)
        return view

    def fire_due(self, limit: int = 100) -> list[str]:
        """One firer pass: the job ids submitted (or found) for due ticks."""
        now, due = self.d.store.schedules_due(limit)
        fired: list[str] = []
        for s in due:
            try:
                tick, following = latest_tick(s.cron, s.tz, now)
            except InvalidInput as exc:
                # A row stored before its expression was refused: pause it, so
                # that it neither fails every pass nor holds up the schedules after it.
                log.error("schedule %s/%s: paused, it has no next tick: %s", s.tenant, s.name, exc)
                self.d.store.schedule_update(s.tenant, s.name, paused=True, next_at=s.next_at)
                continue
            job_id = tick_job_id(s, tick)
            try:
                self.d.submit(_submission(s, job_id))
            except IdempotencyConflict:
                pass  # fired already, before the schedule was edited: that job stands
            except QueueFull as exc:
                log.warning("schedule %s/%s: tick not fired yet: %s", s.tenant, s.name, exc)
                continue  # the next pass tries again
            except InvalidInput as exc:
                # The kind or payload cannot become valid by waiting: skip this tick.
                log.error("schedule %s/%s: tick skipped: %s", s.tenant, s.name, exc)
            self.d.store.schedule_advance(s, next_at=following, last_tick=tick, last_job_id=job_id)
            fired.append(job_id)
        return fired


class Firer:
    """A background thread firing due schedules every :data:`FIRE_EVERY_S`."""

    def __init__(self, dispatcher: Dispatcher, every_s: float = FIRE_EVERY_S) -> None:
        self.schedules = Schedules(dispatcher)
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="schedule-firer", daemon=True)

    def start(self) -> Firer:
        """Start the thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.schedules.fire_due()
            except AgentDispatchError as exc:
                log.warning("schedule pass failed: %s", exc)
            except Exception:  # a firer must outlive a bad row or a driver hiccup
                log.exception("schedule pass failed")
