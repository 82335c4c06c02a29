"""Group commit of concurrent intakes on PostgreSQL: deliveries that arrive
while earlier groups are being written share one statement and one commit,
each gets its own answer and its own durable receipt and WorkItem; a group
that fails stores none of its members, and a delivery the database refuses
does not take the rest of its group down with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentdispatch.backends.postgres.intake import PostgresIntakeStore
from agentdispatch.dispatch import Dispatcher
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.intake.admin import set_agent, set_route
from agentdispatch.intake.admit import Incoming, admit, job_id_of
from agentdispatch.intake.answers import Answer, ok
from agentdispatch.intake.base import Abandoned, Admission
from agentdispatch.intake.envelope import IntakeEnvelope
from agentdispatch.intake.group import Group
from backends import BUILDERS, Harness
from e2e.gatewayproc import Gateway
from intake.kit import TG_BOT, install_telegram_bot, pg_gateway_on, post_tg, tg_update


def _until(cond: Callable[[], bool], what: str) -> None:
    """Wait for a state of another component (no event to wait on there)."""
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- the grouping itself -------------------------------------------------------
def test_callers_arriving_during_a_group_share_the_next_and_get_their_own_results() -> None:
    entered, release = threading.Event(), threading.Event()
    groups: list[list[int]] = []

    def run(args: list[int]) -> list[int | BaseException]:
        groups.append(list(args))
        if len(groups) == 1:
            entered.set()
            release.wait(30)
        return [ValueError(a) if a == 13 else a * 10 for a in args]

    g: Group[int, int] = Group(run, concurrency=1)
    got: dict[int, object] = {}

    def call(a: int) -> None:
        try:
            got[a] = g.call(a)
        except ValueError as exc:
            got[a] = exc

    first = threading.Thread(target=call, args=(1,))
    first.start()
    assert entered.wait(30)
    rest = [threading.Thread(target=call, args=(a,)) for a in (2, 13, 4)]
    for t in rest:
        t.start()
    _until(lambda: g._open is not None and len(g._open.args) == 3, "the next group to fill")
    release.set()
    for t in [first, *rest]:
        t.join(30)
    assert groups[0] == [1] and sorted(groups[1]) == [2, 4, 13] and len(groups) == 2
    assert got[1] == 10 and got[2] == 20 and got[4] == 40 and isinstance(got[13], ValueError)


def test_a_failed_group_fails_every_member_and_the_next_group_runs() -> None:
    calls: list[list[str]] = []

    def run(args: list[str]) -> list[str | BaseException]:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("down")
        return list(args)

    g: Group[str, str] = Group(run)
    with pytest.raises(RuntimeError):
        g.call("a")
    assert g.call("b") == "b"


# -- on PostgreSQL -------------------------------------------------------------
@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = BUILDERS["postgres"](tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def _installed(h: Harness, tmp_path: Path) -> tuple[PostgresIntakeStore, dict[str, Any]]:
    ist, inst = install_telegram_bot(h.store, tmp_path)
    assert isinstance(ist, PostgresIntakeStore)
    return ist, inst


def _update(inst: dict[str, Any], n: int, text: str | None = None) -> Incoming:
    env = IntakeEnvelope(connector="telegram", installation=inst["id"], source_id=f"7:{n}", conversation="42",
                         sender="9", text=text or f"m{n}", channel="42", message_key=f"42:{n}", is_dm=True)  # fmt: skip
    return Incoming("telegram", env.source_id, env.to_json().encode(), ok(), inst, envelope=env)


class _Held:
    """Inserts into the receipts table held by a lock: the first two groups
    (the most that run at once) wait on it, and later deliveries gather in the
    next group."""

    def __init__(self, uri: str, ist: PostgresIntakeStore) -> None:
        self.uri, self.ist = uri, ist
        self.blocker = psycopg.connect(uri)
        self.blocker.execute("LOCK TABLE intake_receipts IN SHARE ROW EXCLUSIVE MODE")
        self.threads: list[threading.Thread] = []
        self.got: dict[int, Answer | BaseException] = {}

    def send(self, d: Dispatcher, inc: Incoming, n: int, deadline: float | None = None) -> None:
        def go() -> None:
            try:
                self.got[n] = admit(self.ist, d, inc, abandoned=threading.Event(), deadline=deadline)
            except Exception as exc:
                self.got[n] = exc

        t = threading.Thread(target=go)
        t.start()
        self.threads.append(t)

    def gathered(self) -> int:
        batch = self.ist._group._open
        return 0 if batch is None else len(batch.args)

    def release(self) -> None:
        self.blocker.rollback()
        self.blocker.close()
        for t in self.threads:
            t.join(60)


def _receipts(uri: str, sources: list[str]) -> list[tuple[str, str]]:
    """(source_id, the id of the transaction that wrote it) of each receipt
    with its WorkItem, as another connection sees them (committed)."""
    with psycopg.connect(uri) as c:
        rows = c.execute(
            "SELECT r.source_id, r.xmin::text FROM intake_receipts r JOIN work_items w ON w.id = r.job_id"
            " WHERE r.source_id = ANY(%s) ORDER BY r.source_id",
            (sources,),
        ).fetchall()
    return [(str(a), str(b)) for a, b in rows]


def test_a_group_commits_its_members_together_each_with_its_own_answer(h: Harness, tmp_path: Path) -> None:
    ist, inst = _installed(h, tmp_path)
    d, uri = h.dispatcher(), h.env["STATE_DB_URI"]
    held = _Held(uri, ist)
    try:
        for n in (1, 2):
            held.send(d, _update(inst, n), n)
        _until(lambda: held.ist._group._running == 2, "both groups to run (held by the lock)")
        for n in (3, 4, 5, 6):
            held.send(d, _update(inst, n), n)
        _until(lambda: held.gathered() == 4, "the next group to gather")
    finally:
        held.release()
    assert all(isinstance(a, Answer) and a.status == 200 for a in held.got.values()), held.got
    assert len(held.got) == 6
    rows = dict(_receipts(uri, [f"7:{n}" for n in range(1, 7)]))
    assert sorted(rows) == [f"7:{n}" for n in range(1, 7)]
    assert len({rows[f"7:{n}"] for n in (3, 4, 5, 6)}) == 1  # one transaction
    assert rows["7:1"] != rows["7:2"] != rows["7:3"]
    for n in range(1, 7):
        assert h.store.get(job_id_of("telegram", f"7:{n}"), None).status == "ready"


def test_a_group_past_its_deadline_stores_none_of_its_members(h: Harness, tmp_path: Path) -> None:
    ist, inst = _installed(h, tmp_path)
    d, uri = h.dispatcher(), h.env["STATE_DB_URI"]
    held = _Held(uri, ist)
    soon = time.monotonic() + 1.0
    try:
        for n in (1, 2):
            held.send(d, _update(inst, n), n, deadline=soon)
        _until(lambda: held.ist._group._running == 2, "both groups to run (held by the lock)")
        for n in (3, 4, 5):
            held.send(d, _update(inst, n), n, deadline=soon + 2.0)
        _until(lambda: held.gathered() == 3, "the next group to gather")
        # The server cancels each group's statement before its callers give up.
        for t in held.threads:
            t.join(60)
    finally:
        held.release()
    assert all(isinstance(held.got[n], Abandoned) for n in range(1, 6)), held.got
    assert _receipts(uri, [f"7:{n}" for n in range(1, 6)]) == []
    with psycopg.connect(uri) as c:
        row = c.execute("SELECT count(*) FROM work_items WHERE kind = 'intake_turn'").fetchone()
        assert row is not None and row[0] == 0


def test_a_delivery_the_database_refuses_fails_alone(h: Harness, tmp_path: Path) -> None:
    """A row the database refuses (here a constraint refuses one source):
    that delivery's group is rolled back, and its other members are
    admitted one by one."""
    ist, inst = _installed(h, tmp_path)
    d, uri = h.dispatcher(), h.env["STATE_DB_URI"]
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("ALTER TABLE intake_receipts ADD CONSTRAINT refuse_one CHECK (source_id <> '7:4')")
    held = _Held(uri, ist)
    try:
        for n in (1, 2):
            held.send(d, _update(inst, n), n)
        _until(lambda: held.ist._group._running == 2, "both groups to run (held by the lock)")
        for n in (3, 4, 5):
            held.send(d, _update(inst, n), n)
        _until(lambda: held.gathered() == 3, "the next group to gather")
    finally:
        held.release()
    assert isinstance(held.got[4], TaskQueueUnavailable)
    assert all(isinstance(held.got[n], Answer) and held.got[n].status == 200 for n in (1, 2, 3, 5)), held.got  # type: ignore[union-attr]
    assert [s for s, _ in _receipts(uri, [f"7:{n}" for n in range(1, 6)])] == ["7:1", "7:2", "7:3", "7:5"]


# -- through the gateway -------------------------------------------------------
@pytest.fixture
def pg_gateway(tmp_path: Path) -> Iterator[tuple[Gateway, str]]:
    with pg_gateway_on(tmp_path / "data", commit_timeout_s="20") as gw:
        yield gw


def test_concurrent_webhooks_held_behind_a_lock_each_get_their_own_200(pg_gateway: tuple[Gateway, str]) -> None:
    gw, uri = pg_gateway
    blocker = psycopg.connect(uri)
    blocker.execute("LOCK TABLE intake_receipts IN SHARE ROW EXCLUSIVE MODE")
    codes: dict[int, int] = {}

    def send(n: int) -> None:
        with gw.client() as c:
            codes[n] = post_tg(c, tg_update(7000 + n)).status_code

    threads = [threading.Thread(target=send, args=(n,)) for n in range(6)]
    try:
        for t in threads:
            t.start()
        with psycopg.connect(uri, autocommit=True) as c:

            def waiting() -> int:
                row = c.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()
                return 0 if row is None else int(row[0])

            _until(lambda: waiting() >= 1, "a group to wait on the lock")
    finally:
        blocker.rollback()
        blocker.close()
        for t in threads:
            t.join(60)
    assert codes == dict.fromkeys(range(6), 200), gw.log()[-3000:]
    sources = [f"{TG_BOT}:{7000 + n}" for n in range(6)]
    assert [s for s, _ in _receipts(uri, sources)] == sorted(sources)


def test_a_nul_in_a_message_is_stored_not_refused_on_every_retry(pg_gateway: tuple[Gateway, str]) -> None:
    # PostgreSQL text cannot hold NUL; refused, Telegram would retry the update forever.
    gw, uri = pg_gateway
    with gw.client() as c:
        assert post_tg(c, tg_update(7100, text="bad\x00text")).status_code == 200, gw.log()[-3000:]
    with psycopg.connect(uri) as c:
        row = c.execute("SELECT envelope FROM intake_receipts WHERE source_id = %s", (f"{TG_BOT}:7100",)).fetchone()
    assert row is not None and IntakeEnvelope.from_json(row[0]).text == "bad\ufffdtext"


# -- lock order between groups ---------------------------------------------------
class _Planned(Exception):
    """Raised by :class:`_Capture` once the admission is planned."""


class _Capture:
    """Stands in for the group: keeps each planned admission, writes nothing."""

    def __init__(self) -> None:
        self.got: list[Admission] = []

    def call(self, a: Admission) -> Any:
        self.got.append(a)
        raise _Planned()


def _planned(ist: PostgresIntakeStore, d: Dispatcher, inst: dict[str, Any], n: int, channel: str) -> Admission:
    env = IntakeEnvelope(connector="telegram", installation=inst["id"], source_id=f"7:{n}", conversation=channel,
                         sender="9", text=f"m{n}", channel=channel, message_key=f"{channel}:{n}",
                         is_dm=True)  # fmt: skip
    inc = Incoming("telegram", env.source_id, env.to_json().encode(), ok(), inst, envelope=env)
    real, capture = ist._group, _Capture()
    ist._group = capture  # type: ignore[assignment]
    try:
        with pytest.raises(_Planned):
            admit(ist, d, inc, abandoned=threading.Event())
    finally:
        ist._group = real
    return capture.got[0]


def _blocked_by(c: psycopg.Connection[Any]) -> dict[int, list[int]]:
    """Backends of this database waiting on a lock: pid -> the pids blocking it."""
    rows = c.execute(
        "SELECT pid, pg_blocking_pids(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchall()
    return {int(pid): [int(b) for b in blockers] for pid, blockers in rows}


def test_two_groups_creating_the_same_new_agents_slots_never_deadlock(h: Harness, tmp_path: Path) -> None:
    """The first deliveries to two new agents, in two concurrent groups in
    opposite agent order: each group created an agent's backlog slots when
    it reached its delivery, so each waited for the slots the other had just
    created. PostgreSQL broke the cycle after deadlock_timeout (1 s by
    default: every webhook meanwhile waited) and one group ran again. The
    slots of a group's agents are now created first, in the order of their
    names, so the second group waits for the first and nothing more."""
    ist, inst = _installed(h, tmp_path)
    d, uri = h.dispatcher(), h.env["STATE_DB_URI"]
    for agent, channel in (("agent-a", "a"), ("agent-b", "b")):
        set_agent(ist, agent, enabled=True)
        set_route(ist, inst["id"], channel, agent)
    # Group 1: agent a then agent b; group 2: agent b then agent a.
    first = [_planned(ist, d, inst, 1, "a"), _planned(ist, d, inst, 2, "b")]
    second = [_planned(ist, d, inst, 3, "b"), _planned(ist, d, inst, 4, "a")]
    with psycopg.connect(uri, autocommit=True) as c:
        # A gate before the second delivery of each group: both groups stop
        # there until the test opens it.
        c.execute(
            "CREATE FUNCTION gate() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NEW; END $$"
        )
        c.execute(
            "CREATE TRIGGER gate BEFORE INSERT ON intake_receipts FOR EACH ROW"
            " WHEN (NEW.source_id IN ('7:2', '7:4')) EXECUTE FUNCTION gate()"
        )
        c.execute("SELECT pg_advisory_lock(4242)")
        got: dict[int, Any] = {}

        def run(k: int, group: list[Admission]) -> None:
            got[k] = ist._admit_group(group)

        threads = [threading.Thread(target=run, args=(k, g)) for k, g in ((1, first), (2, second))]
        cycles: list[dict[int, list[int]]] = []
        try:
            threads[0].start()
            _until(lambda: len(_blocked_by(c)) == 1, "group 1 to reach its gate")
            threads[1].start()
            _until(lambda: len(_blocked_by(c)) == 2, "group 2 to wait (on its gate or on group 1)")
            c.execute("SELECT pg_advisory_unlock(4242)")
            while any(t.is_alive() for t in threads):
                waits = _blocked_by(c)
                if any(p in waits.get(b, []) for p, bs in waits.items() for b in bs):
                    cycles.append(waits)
                time.sleep(0.005)
        finally:
            c.execute("SELECT pg_advisory_unlock_all()")
            for t in threads:
                t.join(60)
    assert cycles == [], cycles[:1]
    for k in (1, 2):
        assert [row["outcome"] for row, _ in got[k]] == ["accepted", "accepted"], got[k]
    assert [s for s, _ in _receipts(uri, ["7:1", "7:2", "7:3", "7:4"])] == ["7:1", "7:2", "7:3", "7:4"]
