"""Seed 002's promises, checked as an operator would on SQLite and PostgreSQL:
a real gateway, real worker processes and a fake Bot API on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentdispatch.intake.admit import BACKLOG_PER_AGENT
from agentdispatch.intake.handler import ACKNOWLEDGEMENT
from intake.kit import TG_BOT
from intake.sitekit import Site, send, site, tg_job, wait_for

#: Seed 002, "Bounds and inspection", verbatim.
SEED_COUNTS = "SELECT status, count(*) FROM work_items GROUP BY status ORDER BY status;"
SEED_PROBLEMS = """SELECT id, agent_id, status, reason, created_at, ready_at,
       intake_attempts, turn_attempts, run_id
FROM work_items
WHERE status IN ('failed', 'interrupted', 'cancelled', 'stale')
ORDER BY completed_at DESC LIMIT 50;"""


@pytest.fixture(params=["sqlite", "postgres"])
def s(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    with site(tmp_path, request.param) as got:
        yield got


def test_follow_up_during_the_reply_call_is_steered_into_the_run(s: Site) -> None:
    gw = s.gateway("--no-auth")
    s.worker()
    s.worker()
    first, follow = tg_job(1), tg_job(2)
    s.prov.released.clear()  # the first reply call stays in flight
    with gw.client() as c:
        assert send(c, 1, "first").status_code == 200
        s.prov.wait_calls(1)
        assert send(c, 2, "and also this").status_code == 200
    s.prov.released.set()
    s.wait_terminal(first, follow)
    assert (s.receipt(follow)["state"], s.receipt(follow)["steered_into"]) == ("steered", first)
    assert json.loads(s.item(first)["result"])["steered"] == 1
    assert json.loads(s.item(follow)["result"])["disposition"] == "steered"
    calls = s.prov.snapshot()
    # Every reply belongs to the one run; the follow-up never started a turn of its own.
    assert [key for _, key, _ in calls] == [f"intake-reply:{first}:0", f"intake-reply:{first}:1"]
    # The built-in responder acknowledges without repeating the customer's words.
    assert [call[2]["text"] for call in calls] == [ACKNOWLEDGEMENT, ACKNOWLEDGEMENT]


def test_a_full_backlog_is_retried_not_rejected_for_good(s: Site) -> None:
    gw = s.gateway("--no-auth")  # no workers: nothing leaves the backlog by itself
    extra = BACKLOG_PER_AGENT + 1
    refusal = "SELECT state, reason, job_id, agent FROM intake_receipts WHERE source_id = ?"
    with gw.client() as c:
        for n in range(1, extra):
            assert send(c, n, chat=100 + n).status_code == 200
        full = send(c, extra, chat=9)
        assert full.status_code == 503 and full.headers["Retry-After"].isdigit()
        assert "backlog_full" in full.text
        # A rejected receipt says why, and no WorkItem was made.
        rejected = {"state": "rejected", "reason": "backlog_full", "job_id": None, "agent": "helper"}
        assert s.rows(refusal, f"{TG_BOT}:{extra}") == [rejected]
        assert s.rows("SELECT id FROM work_items WHERE id = ?", tg_job(extra)) == []
        again = send(c, extra, chat=9)  # the provider's retry while still full: refused again, one receipt
        assert again.status_code == 503 and again.headers["Retry-After"].isdigit()
        assert s.rows(refusal, f"{TG_BOT}:{extra}") == [rejected]
        assert send(c, 1, chat=101).status_code == 200  # a duplicate still succeeds
        assert 'agent_utilities_dispatch_intake_backlog_full_total{connector="telegram"} 2.0' in c.get("/metrics").text
        s.cli("cancel", tg_job(1), "--tenant", "acme")  # a slot frees
        assert send(c, extra, chat=9).status_code == 200  # the provider's retry is accepted
        assert send(c, extra, chat=9).status_code == 200  # and its copies are its duplicates
    assert s.receipt(tg_job(extra))["state"] == "accepted"
    assert s.rows(refusal, f"{TG_BOT}:{extra}") == [
        {"state": "accepted", "reason": None, "job_id": tg_job(extra), "agent": "helper"}
    ]
    assert s.item(tg_job(extra))["status"] == "ready"


def test_stale_and_rejected_work_is_found_by_the_seed_queries(s: Site) -> None:
    s.cli("intake", "agent", "add", "other")
    s.cli("intake", "route", "set", s.inst.telegram, "77", "other")
    s.cli("intake", "agent", "disable", "other")  # admitted for it, rejected at execution
    gw = s.gateway("--no-auth")
    with gw.client() as c:
        assert send(c, 1, "too late", chat=42).status_code == 200
        received = float(s.receipt(tg_job(1))["received_at"])
        # A one-second window, by the database's own clock: no waiting five minutes.
        wait_for(lambda: _db_now(s) > received + 1.2, "the trigger to be older than the window")
        s.stop_worker(s.worker(AGENT_DISPATCH_INTAKE_STALE_S="1"), after=[tg_job(1)])
        assert send(c, 2, "wrong owner", chat=77).status_code == 200
    s.worker()
    s.wait_terminal(tg_job(2))
    found = {r["id"]: r for r in s.rows(SEED_PROBLEMS)}
    stale, rejected = found[tg_job(1)], found[tg_job(2)]
    assert (stale["status"], stale["reason"], stale["agent_id"]) == ("cancelled", "stale", "helper")
    assert (rejected["status"], rejected["reason"], rejected["agent_id"]) == ("failed", "agent_disabled", "other")
    assert (stale["intake_attempts"], stale["turn_attempts"]) == (1, 0)
    counts = {r["status"]: r["count"] for r in s.rows(SEED_COUNTS.replace("count(*)", "count(*) AS count"))}
    assert counts == {"cancelled": 1, "failed": 1}
    assert len(s.rows(SEED_COUNTS)) == 2
    assert s.prov.snapshot() == []


def _db_now(s: Site) -> float:
    if s.backend == "postgres":
        return float(s.rows("SELECT extract(epoch FROM clock_timestamp()) AS t")[0]["t"])
    return time.time()  # the SQLite store's clock


def test_scrub_age_is_a_setting(s: Site) -> None:
    gw = s.gateway("--no-auth", AGENT_DISPATCH_INTAKE_SCRUB_AGE_S="1", AGENT_DISPATCH_INTAKE_SCRUB_EVERY_S="0.2")
    with gw.client() as c:
        assert send(c, 1).status_code == 200
        assert send(c, 2, chat=43).status_code == 200
    s.cli("cancel", tg_job(1), "--tenant", "acme")

    def scrubbed() -> bool:
        return s.receipt(tg_job(1))["raw"] is None

    wait_for(scrubbed, "the gateway to scrub the terminal body")
    assert s.receipt(tg_job(2))["raw"] is not None  # not terminal: kept
    bad = s.cli_fails("intake", "scrub", AGENT_DISPATCH_INTAKE_SCRUB_AGE_S="-1")
    assert "AGENT_DISPATCH_INTAKE_SCRUB_AGE_S" in bad


def test_conversation_history_is_readable_after_coalescing(s: Site) -> None:
    gw = s.gateway()  # authentication on, as deployed
    with gw.client() as c:
        for n, text in enumerate(["one", "two", "three"], start=1):
            assert send(c, n, text, user=n).status_code == 200
    s.worker()
    s.wait_terminal(tg_job(1), tg_job(2), tg_job(3))
    assert [s.receipt(tg_job(n))["state"] for n in (1, 2, 3)] == ["coalesced", "coalesced", "replied"]
    conv = "42"
    out = json.loads(s.cli("intake", "messages", s.inst.telegram, conv, "--tenant", "acme", "--json"))
    assert [m["text"] for m in out if m["role"] == "user"] == ["one", "two", "three"]
    assert [m["role"] for m in out][-1] == "agent"
    path = f"/intake/conversations/{s.inst.telegram}/{conv}/messages"
    with s.client(gw, "acme") as c:
        got = c.get(path)
        assert got.status_code == 200 and got.json()["messages"] == out
    with s.client(gw, "someone-else") as c:
        assert c.get(path).status_code == 404
    with gw.client() as c:
        assert c.get(path).status_code == 401
    assert "not found" in s.cli_fails("intake", "messages", s.inst.telegram, conv, "--tenant", "someone-else")


def test_an_update_no_store_can_hold_is_a_rejected_receipt_not_a_503(s: Site) -> None:
    # A lone surrogate is a valid JSON escape but not Unicode text: storing
    # the update failed, and the 503 had the provider resend it for good.
    gw = s.gateway("--no-auth")
    with gw.client() as c:
        assert send(c, 1, "half an emoji \ud83d").status_code == 200
        assert send(c, 1, "half an emoji \ud83d").status_code == 200  # a duplicate, answered alike
        assert send(c, 2, "a whole one \U0001f600").status_code == 200
    rows = s.rows("SELECT state, reason, job_id FROM intake_receipts")
    assert sorted((r["state"], r["reason"] or "") for r in rows) == [("accepted", ""), ("rejected", "malformed")]
    assert s.receipt(tg_job(2))["state"] == "accepted"
