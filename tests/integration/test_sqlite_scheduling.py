"""Claim order on SQLite, the same as PostgreSQL's fair claim: expired
deadlines first, priority, least-recently-served tenant and session, deadline,
submission order; fairness rows are pruned; the claim is index lookups only."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentdispatch.backends.sqlite import transport as sqlite_transport
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.backends.sqlite.transport import SqliteTransport, get_on, release_on
from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import LeaseGuard
from agentdispatch.sqlfiles import queries
from agentdispatch.stores import schema
from agentdispatch.transports.base import Delivery
from backends import Harness, sqlite_harness
from contract.helpers import wait_until


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = sqlite_harness(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def _drain(h: Harness) -> list[str]:
    """Claim and acknowledge one at a time: job ids in claim order."""
    out = []
    while (d := h.transport.get("t:0", visibility_s=30.0, wait_s=0.0)) is not None:
        out.append(Envelope.from_json(d.raw).job_id)
        assert h.transport.ack(d)
    return out


def test_expired_first_then_priority_then_deadline_then_submission_order(h: Harness) -> None:
    d = h.dispatcher()
    now = time.time()
    spec = [
        ("low", 0, None),
        ("high-late", 10, now + 3000),
        ("mid", 5, None),
        ("high-soon", 10, now + 1000),
        ("expired-low", -5, now - 10),
        ("high-none", 10, None),
        ("low-2", 0, None),
    ]
    for name, prio, deadline in spec:
        d.submit(Submission(kind="echo", job_id=name, tenant="a", priority=prio, deadline_unix=deadline))
    assert _drain(h) == ["expired-low", "high-soon", "high-late", "high-none", "mid", "low", "low-2"]


def test_one_tenants_turns_do_not_all_run_before_anothers_first(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="echo", job_id=f"a{k}", tenant="a") for k in range(4)])
    d.submit(Submission(kind="echo", job_id="b0", tenant="b"))
    assert _drain(h) == ["a0", "b0", "a1", "a2", "a3"]


def test_least_recently_served_tenant_then_session(h: Harness) -> None:
    d = h.dispatcher()
    # Tenant a: 3 sessions x 2 turns; tenant b: 1 session x 3 turns; all one priority.
    subs = [
        Submission(kind="echo", job_id=f"a-s{s}-{k}", tenant="a", session_id=f"s{s}")
        for k in range(2)
        for s in range(3)
    ]
    subs += [Submission(kind="echo", job_id=f"b-x-{k}", tenant="b", session_id="x") for k in range(3)]
    d.submit_many(subs)
    got = []
    # Claim without acking: only session heads are eligible (head-of-line).
    while (dl := h.transport.get("t:0", visibility_s=30.0, wait_s=0.0)) is not None:
        got.append((Envelope.from_json(dl.raw).job_id, dl))
    assert [j for j, _ in got] == ["a-s0-0", "b-x-0", "a-s1-0", "a-s2-0"]
    for _, dl in got:
        assert h.transport.ack(dl)
    # b was served longest ago; a's sessions in the order a served them.
    assert _drain(h) == ["b-x-1", "a-s0-1", "b-x-2", "a-s1-1", "a-s2-1"]


def test_fairness_rows_are_pruned_when_nothing_is_queued(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="echo", tenant=f"t{i % 3}", session_id=f"s{i % 5}") for i in range(30)])
    c = h.store.db.conn()

    def count(table: str) -> int:
        return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    assert count("dispatch_fair_tenants") == 3
    assert len(_drain(h)) == 30
    assert [count(t) for t in ("dispatch_fair_tenants", "agent_dispatch_queue")] == [0, 0]


def test_fair_claim_reads_by_index_only(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="echo", tenant=f"t{i % 50}", session_id=f"s{i % 500}") for i in range(2000)])
    sql = queries("agentdispatch.backends.sqlite.sql", "transport.sql")["get"]
    plan = [
        str(r[3])
        for r in h.store.db.conn().execute("EXPLAIN QUERY PLAN " + sql, {"owner": "x", "now": time.time(), "vis": 1.0})
    ]
    # The tenant walk is the only scan of a table: the small fairness index, in
    # order (read through a coroutine); each tenant's heads are an index search.
    scans = [p for p in plan if p.startswith("SCAN") and not p.startswith("SCAN (subquery")]
    assert scans == ["SCAN t USING COVERING INDEX fair_tenants_open"], plan
    assert any("USING INDEX queue_fair" in p for p in plan), plan
    # Claimed rows and the rows behind the heads are outside the range searched.
    assert any("queue_fair (tenant_ref=? AND priority=? AND hidden=? AND group_served<?)" in p for p in plan), plan


def _short_claim_steps(h: Harness) -> int:
    """The virtual machine steps of a claim that finds nothing."""
    steps = 0

    def tick() -> int:
        nonlocal steps
        steps += 1
        return 0

    with h.store.db.tx() as c:
        c.set_progress_handler(tick, 1)
        try:
            assert get_on(c, "t:0", 30.0) is None
        finally:
            c.set_progress_handler(None, 1)
    return steps


def test_a_short_claim_reads_neither_claimed_rows_nor_rows_behind_heads(h: Harness) -> None:
    d = h.dispatcher()
    steps = []
    for sessions in (10, 500):
        # Each session: a head, claimed and held, and three turns behind it.
        subs = [
            Submission(kind="echo", tenant=f"t{s % 5}", session_id=f"n{sessions}-s{s}")
            for _ in range(4)
            for s in range(sessions)
        ]
        d.submit_many(subs)
        while h.transport.get("t:0", visibility_s=30.0, wait_s=0.0) is not None:
            pass
        steps.append(_short_claim_steps(h))
    # Fifty times the turns in flight and behind them: the same few index seeks.
    few, many = steps
    assert many <= few + 10, steps


def test_a_claim_whose_visibility_ran_out_is_claimable_at_that_moment(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = h.dispatcher()
    d.submit(Submission(kind="echo", job_id="one", tenant="a"))
    now = time.time()

    def at(t: float) -> None:
        monkeypatch.setattr(sqlite_transport, "clock", lambda: t)

    c = h.store.db
    at(now)
    with c.tx() as conn:
        first = get_on(conn, "dead:0", 30.0)
    assert first is not None and first.deliveries == 1
    # Its worker died holding it: nobody else gets it while it is invisible...
    at(now + 29.999)
    with c.tx() as conn:
        assert get_on(conn, "t:1", 30.0) is None
    # ...and the first claim at its visible_at gets it, with no extra delay.
    at(now + 30.0)
    with c.tx() as conn:
        again = get_on(conn, "t:1", 30.0)
    assert again is not None and Envelope.from_json(again.raw).job_id == "one" and again.deliveries == 2
    # A release with a delay: hidden until the delay has passed, not after.
    at(now + 31.0)
    with c.tx() as conn:
        release_on(conn, again, 5.0)
    at(now + 35.999)
    with c.tx() as conn:
        assert get_on(conn, "t:1", 30.0) is None
    at(now + 36.0)
    with c.tx() as conn:
        third = get_on(conn, "t:1", 30.0)
    assert third is not None and third.deliveries == 3


def test_a_head_enqueued_in_front_of_its_session_is_claimed(h: Harness) -> None:
    # A turn whose dependency settled after a later turn of its session was
    # queued (or one queued again) becomes its session's head from behind.
    enqueue = queries("agentdispatch.backends.sqlite.sql", "queries.sql")["enqueue"]
    now = time.time()
    with h.store.db.tx() as c:
        for job, seq, session in (("other", 1, "s1"), ("later", 3, "s0"), ("front", 2, "s0")):
            c.execute(enqueue, (job, seq, session, "tenant", 0, None, job, now, now))
    got = []
    while (dl := h.transport.get("t:0", visibility_s=30.0, wait_s=0.0)) is not None:
        got.append(dl.raw)
        assert h.transport.ack(dl)
    # It sorts after the tenant's other heads (as +Inf placed it), then its
    # session's next turn follows.
    assert got == ["other", "front", "later"]


def test_a_worker_serves_small_tenants_between_a_big_tenants_turns(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="note", tenant="big", payload="big") for _ in range(200)])
    d.submit_many([Submission(kind="note", tenant=f"small{k}", payload=f"small{k}") for k in range(3) for _ in "12345"])
    order: list[str] = []
    lock = threading.Lock()
    reg = Registry()

    @reg.register("note")
    def note(turn: Turn, guard: LeaseGuard) -> None:
        with lock:
            order.append(turn.payload)

    worker = h.worker(reg, threads=1)
    worker.start()
    try:
        wait_until(lambda: len(order) >= 40, timeout=60)
    finally:
        worker.stop(grace_s=5)
    # Four tenants take turns: every small tenant's five turns are among the first 20 claims.
    first = order[:20]
    assert all(first.count(f"small{k}") == 5 for k in range(3)), order[:40]
    assert first[:4].count("big") == 1, order[:40]


def test_migration_018_hides_held_rows_and_keeps_heads_enqueued_in_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = "agentdispatch.backends.sqlite.sql"
    path = tmp_path / "old.sqlite"
    base = schema.steps(package)[:1]
    monkeypatch.setattr(schema, "steps", lambda _package: base)
    old = SqliteStore(path)
    old.migrate()
    assert old.schema_version() == 17
    now = time.time()
    rows = [
        # (job, seq, session, group_served, visible_at, claimed_by): as the old release wrote them.
        ("held", 1, "s0", now - 1, now + 30, "dead:0"),
        ("behind-held", 2, "s0", 9e999, now - 5, None),
        ("front", 3, "s1", 9e999, now - 5, None),
        ("displaced", 4, "s1", now - 100, now - 5, None),
        ("fresh", 5, "s2", 0.0, now - 5, None),
    ]
    with old.db.tx() as c:
        c.executemany(
            "INSERT INTO agent_dispatch_queue (job_id, item_seq, session_ref, tenant_ref, priority, envelope, "
            "enqueued_at, visible_at, group_served, claimed_by) VALUES (?, ?, ?, 'tenant', 0, ?, ?, ?, ?, ?)",
            [(j, seq, ses, j, now - 10, vis, served, who) for j, seq, ses, served, vis, who in rows],
        )
    old.close()
    monkeypatch.undo()
    store = SqliteStore(path)
    try:
        store.migrate()
        got = {
            job: (hidden, served)
            for job, hidden, served in store.db.conn().execute(
                "SELECT job_id, hidden, group_served FROM agent_dispatch_queue"
            )
        }
        # The held head is hidden; the head in front sorts last, below +Inf.
        assert got == {
            "held": (1, now - 1),
            "behind-held": (0, float("inf")),
            "front": (0, 1e308),
            "displaced": (0, now - 100),
            "fresh": (0, 0.0),
        }
        transport = SqliteTransport(store.db)
        claimed = []
        while (dl := transport.get("t:0", visibility_s=30.0, wait_s=0.0)) is not None:
            claimed.append(dl.raw)
        assert claimed == ["fresh", "front"]
    finally:
        store.close()


def test_a_short_claim_does_not_visit_tenants_whose_heads_are_claimed(h: Harness) -> None:
    d = h.dispatcher()
    steps = []
    for tenants in (10, 500):
        # A fleet of one-conversation customers: each tenant's one head is claimed and held.
        d.submit_many([Submission(kind="echo", tenant=f"n{tenants}-t{t}", session_id="s") for t in range(tenants)])
        while h.transport.get("t:0", visibility_s=30.0, wait_s=0.0) is not None:
            pass
        steps.append(_short_claim_steps(h))
    # Fifty times the tenants in flight: the same few index seeks, no walk over them.
    few, many = steps
    assert many <= few + 10, steps


def _searchable(c: sqlite3.Connection) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int]]:
    """Whether each tenant has a row to search, as the triggers kept it and as its rows say."""
    kept = {(p, t): n for p, t, n in c.execute("SELECT priority, tenant_ref, searchable FROM dispatch_fair_tenants")}
    rows = {
        (p, t): n
        for p, t, n in c.execute(
            "SELECT priority, tenant_ref, max(hidden = 0 AND group_served < 9e999) "
            "FROM agent_dispatch_queue GROUP BY priority, tenant_ref"
        )
    }
    return kept, rows


def test_each_change_of_a_row_keeps_its_tenant_count_and_no_tenant_starves(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    sql = queries("agentdispatch.backends.sqlite.sql", "queries.sql")
    now = time.time()
    monkeypatch.setattr(sqlite_transport, "clock", lambda: now)
    c = h.store.db

    def check() -> None:
        with c.tx() as conn:
            kept, rows = _searchable(conn)
        assert kept == rows

    def enqueue(job: str, seq: int, session: str, tenant: str, prio: int = 0, later: float = 0.0) -> None:
        with c.tx() as conn:
            conn.execute(sql["enqueue"], (job, seq, session, tenant, prio, None, job, now, now + later))
        check()

    def get(vis: float = 30.0) -> Delivery | None:
        with c.tx() as conn:
            got = get_on(conn, "w:0", vis)
        check()
        return got

    # Heads, rows behind them, two priorities, a turn for later, a head enqueued in front.
    enqueue("a1", 1, "sa", "a")
    enqueue("a2", 2, "sa", "a")
    enqueue("b1", 3, "sb", "b", prio=5)
    enqueue("c-later", 4, "sc", "c", later=10.0)
    enqueue("d2", 6, "sd", "d")
    enqueue("d1", 5, "sd", "d")
    # Claims hide the heads and take their tenants out of the walk; a claim
    # with no visibility leaves its row to search.
    b1, a1, d1 = get(), get(), get()
    assert [x.raw if x else None for x in (b1, a1, d1)] == ["b1", "a1", "d1"]
    assert b1 is not None and a1 is not None and d1 is not None
    assert get() is None
    with c.tx() as conn:
        # Tenant d keeps a row to search (d2, stamped before d1 came in front), so it stays in the walk.
        walked = conn.execute("SELECT tenant_ref FROM dispatch_fair_tenants WHERE searchable = 1").fetchall()
        assert [t for (t,) in walked] == ["d"]
    # An acknowledgement: the next row of the session becomes a head to search.
    assert h.transport.ack(a1)
    check()
    a2 = get(vis=0.0)
    assert a2 is not None and a2.raw == "a2"
    assert h.transport.ack(a2)
    check()
    # A give-back without and with a delay; the delayed one is searched when it is due.
    with c.tx() as conn:
        release_on(conn, b1, 5.0)
        release_on(conn, d1, 0.0)
    check()
    d1 = get()
    assert d1 is not None and d1.raw == "d1"
    assert get() is None
    monkeypatch.setattr(sqlite_transport, "clock", lambda: now + 5.0)
    b1 = get()
    assert b1 is not None and b1.raw == "b1"
    # A lease that ran out: the reaper takes the stamp back, the visibility ends.
    with c.tx() as conn:
        conn.execute(sql["unserve"], ("b1",))
    check()
    monkeypatch.setattr(sqlite_transport, "clock", lambda: now + 40.0)
    # The turn enqueued for later and the held claims whose visibility ran out.
    got = sorted(x.raw for x in iter(get, None))
    assert got == ["b1", "c-later", "d1"], got
    # A dead worker's claims given back at once, then rows deleted unclaimed.
    with c.tx() as conn:
        conn.execute(sql["release_claims"], {"prefix": "w:", "now": now + 40.0})
    check()
    with c.tx() as conn:
        conn.execute(sql["purge_queue"], {"id": "d1"})
        conn.execute(sql["purge_queue"], {"id": "b1"})
    check()
    assert sorted(x.raw for x in iter(get, None)) == ["c-later", "d2"]
    with c.tx() as conn:
        conn.execute("DELETE FROM agent_dispatch_queue")
        assert conn.execute("SELECT count(*) FROM dispatch_fair_tenants").fetchone()[0] == 0


def test_migration_019_counts_each_tenants_rows_to_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = "agentdispatch.backends.sqlite.sql"
    path = tmp_path / "old.sqlite"
    steps = schema.steps(package)
    assert [s.version for s in steps][:3] == [17, 18, 19]
    monkeypatch.setattr(schema, "steps", lambda _package: steps[:2])
    old = SqliteStore(path)
    old.migrate()
    assert old.schema_version() == 18
    enqueue = queries(package, "queries.sql")["enqueue"]
    now = time.time()
    with old.db.tx() as c:
        for job, seq, session, tenant in (
            ("held", 1, "s0", "held"),
            ("behind", 2, "s0", "held"),
            ("free", 3, "s1", "free"),
            ("free-2", 4, "s2", "free"),
        ):
            c.execute(enqueue, (job, seq, session, tenant, 0, None, job, now, now))
        # Claimed and held as the old release's claim left it.
        c.execute(
            "UPDATE agent_dispatch_queue SET claimed_by = 'dead:0', claimed_at = ?1, visible_at = ?1 + 30, "
            "deliveries = 1, group_served = ?1, hidden = 1 WHERE job_id = 'held'",
            (now,),
        )
    old.close()
    monkeypatch.undo()
    store = SqliteStore(path)
    try:
        store.migrate()
        c = store.db.conn()
        assert dict(c.execute("SELECT tenant_ref, searchable FROM dispatch_fair_tenants")) == {"held": 0, "free": 1}
        transport = SqliteTransport(store.db)
        claimed = [dl.raw for dl in iter(lambda: transport.get("t:0", visibility_s=30.0, wait_s=0.0), None)]
        assert claimed == ["free", "free-2"]
        kept, rows = _searchable(c)
        assert kept == rows
    finally:
        store.close()


def test_tenant_counts_stay_right_through_random_claims_and_give_backs(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    sql = queries("agentdispatch.backends.sqlite.sql", "queries.sql")
    rng = random.Random(19)
    clock = [time.time()]
    monkeypatch.setattr(sqlite_transport, "clock", lambda: clock[0])
    c = h.store.db
    held: list[Delivery] = []
    seq = 0
    for _ in range(400):
        op = rng.choice(["enqueue", "enqueue", "get", "get", "ack", "release", "tick", "unserve", "purge", "dead"])
        with c.tx() as conn:
            if op == "enqueue":
                seq += 1
                later = rng.choice([0.0, 0.0, 2.0])
                # Sometimes a head enqueued in front of its session (a sequence number already passed).
                item_seq = seq if rng.random() < 0.9 else rng.randint(1, seq)
                tenant, session = f"t{rng.randint(0, 5)}", f"s{rng.randint(0, 12)}"
                row = (f"j{seq}", item_seq, session, tenant, rng.choice([0, 5]), None, f"j{seq}")
                conn.execute(sql["enqueue"], (*row, clock[0], clock[0] + later))
            elif op == "get":
                got = get_on(conn, "w:0", rng.choice([0.0, 3.0, 3.0]))
                if got is not None:
                    held.append(got)
            elif op in ("ack", "release") and held:
                d = held.pop(rng.randrange(len(held)))
                if op == "ack":
                    conn.execute("DELETE FROM agent_dispatch_queue WHERE id = ?", (d.receipt.ref,))
                else:
                    release_on(conn, d, rng.choice([0.0, 2.0]))
            elif op == "tick":
                clock[0] += 1.0
            elif op == "unserve" and held:
                job = conn.execute("SELECT job_id FROM agent_dispatch_queue WHERE id = ?", (held[0].receipt.ref,))
                for (job_id,) in job:
                    conn.execute(sql["unserve"], (job_id,))
            elif op == "purge":
                conn.execute(sql["purge_queue"], {"id": f"j{rng.randint(1, max(1, seq))}"})
            elif op == "dead":
                conn.execute(sql["release_claims"], {"prefix": "w:", "now": clock[0]})
            kept, rows = _searchable(conn)
        assert kept == rows, op
    # Nothing starves: once every visibility has run out, every row is claimed in turn.
    clock[0] += 60.0
    left = int(c.conn().execute("SELECT count(*) FROM agent_dispatch_queue").fetchone()[0])
    assert left > 0
    claimed = 0
    while True:
        with c.tx() as conn:
            got = get_on(conn, "w:1", 30.0)
            if got is None:
                break
            conn.execute("DELETE FROM agent_dispatch_queue WHERE id = ?", (got.receipt.ref,))
            kept, rows = _searchable(conn)
        assert kept == rows
        claimed += 1
    assert claimed == left
    assert c.conn().execute("SELECT count(*) FROM dispatch_fair_tenants").fetchone()[0] == 0
