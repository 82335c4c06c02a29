"""The dashboard in real headless Chromium against a real gateway, used as an
on-call person would: search across pages, a job's payload, error, traceback
and timeline, a drawer that follows the job, the activity chart and depth per
tenant and kind, cancel and bulk DLQ actions behind a confirmation, and a
layout that fits a 390 px phone. Screenshots of each view at desktop and
phone width go to ``$AGENTDISPATCH_ARTIFACTS`` (default: the test's tmp dir);
the directory is printed. The new routes' auth and validation are checked
over plain HTTP."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from agentdispatch.dispatch import Submission
from agentdispatch.errors import JobNotFound
from agentdispatch.handlers import Registry, failure_outcome
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Status
from backends import Harness, sqlite_harness
from e2e.gatewayproc import Gateway, start_gateway

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1400, "height": 950}
PHONE = {"width": 390, "height": 844}
#: A phone page taller than this many screens is not one an on-call person scrolls.
PHONE_SCREENS = 4
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}")


@pytest.fixture()
def setup(tmp_path: Path) -> Iterator[tuple[Gateway, Harness]]:
    h = sqlite_harness(tmp_path, max_attempts=1)  # one failure dead-letters
    gw = start_gateway(tmp_path / "data")
    try:
        yield gw, h
    finally:
        gw.stop()
        h.close()


@pytest.fixture()
def shots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Path]:
    """Where screenshots go; reported in the test output."""
    root = Path(os.environ.get("AGENTDISPATCH_ARTIFACTS") or tmp_path / "screenshots")
    root.mkdir(parents=True, exist_ok=True)
    yield root
    with capsys.disabled():
        print(f"\ndashboard screenshots: {root} ({len(list(root.glob('*.png')))} files)")


@pytest.fixture()
def page() -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser.new_page(viewport=DESKTOP)
        finally:
            browser.close()


def _boom(turn: Any, guard: Any) -> None:
    guard.side_effect("notify-customer", lambda: {"sent": True})
    raise RuntimeError("downstream API refused the request")


def _dead_letter_via_worker(h: Harness, tenant: str) -> str:
    """A real worker runs a handler that always raises; max attempts is 1."""
    handle = h.dispatcher().submit(
        Submission(kind="boom", tenant=tenant, session_id="support-42", payload={"order": 42, "note": "refund"})
    )
    reg = Registry()
    reg.add("boom", _boom)
    worker = h.worker(reg, threads=1)
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while h.store.get(handle.job_id, tenant).status is not Status.DEAD_LETTER:
            assert time.monotonic() < deadline, h.store.get(handle.job_id, tenant)
            time.sleep(0.05)
    finally:
        worker.stop(grace_s=5)
    return handle.job_id


def _dead_letters(h: Harness, tenant: str, n: int) -> list[str]:
    """``n`` dead letters made by claiming and failing them in the store."""
    ids = []
    for i in range(n):
        job_id = h.dispatcher().submit(Submission(kind="flaky", tenant=tenant, payload={"i": i})).job_id
        claim = h.store.claim(job_id, tenant, owner="worker-x", ttl_s=30)
        assert claim.kind is ClaimKind.CLAIMED and claim.lease is not None
        try:
            raise ConnectionError(f"upstream reset #{i}")
        except ConnectionError as exc:
            outcome = failure_outcome(exc)
        assert outcome is not None
        assert h.store.commit(claim.lease, outcome).status is Status.DEAD_LETTER
        ids.append(job_id)
    return ids


def _shot(page: Page, root: Path, name: str, *, full_page: bool = True) -> None:
    """A screenshot named by view and width (the drawer and dialogs float over
    the page, so they are shot as the screen shows them)."""
    width = page.viewport_size["width"] if page.viewport_size else 0
    path = root / f"{name}-{'phone' if width <= 400 else 'desktop'}.png"
    page.screenshot(path=str(path), full_page=full_page)
    assert path.stat().st_size > 10_000


def _page_size(page: Page) -> tuple[int, int]:
    return page.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")


def test_dashboard_serves_an_on_call_person(setup: tuple[Gateway, Harness], page: Page, shots: Path) -> None:
    gw, h = setup
    dead = _dead_letter_via_worker(h, "acme")
    bulk = _dead_letters(h, "acme", 3)
    with gw.client("acme") as api:
        needles = [api.post("/v1/jobs", json={"kind": "needle"}).json()["job_id"] for _ in range(5)]
        hay = [{"kind": "hay", "payload": {"n": i}} for i in range(30)]
        assert api.post("/v1/jobs/batch", json={"jobs": hay}).status_code == 202
        fresh = api.post("/v1/jobs", json={"kind": "echo", "payload": {"hello": "world"}}).json()["job_id"]
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(gw.url + "/")
    expect(page.locator("#notice")).to_contain_text("bearer token")  # no token yet: 401 explained
    page.fill("#token", gw.token("acme"))
    page.click("#login button[type=submit]")
    expect(page.get_by_test_id("tenant")).to_have_text("tenant acme")
    expect(page.locator('#status-chips [data-status="dead_letter"] .n')).to_have_text("4")
    expect(page.locator(f'#jobs tr[data-job="{fresh}"] .badge')).to_have_text("ready")

    # Depth per kind (a tenant sees its own), and the last hour's chart.
    expect(page.locator('#depth-kinds li[data-name="hay"] .n')).to_have_text("30")
    expect(page.locator('#depth-kinds li[data-name="needle"] .n')).to_have_text("5")
    expect(page.locator('#depth-tenants li[data-name="acme"] .n')).to_have_text("36")
    expect(page.get_by_test_id("activity-sum")).to_have_text("40 accepted, 4 finished, 36 open now")
    expect(page.locator("#chart svg.activity")).to_have_attribute("data-points", "60")
    expect(page.locator("#chart .cbar.b-failed")).not_to_have_count(0)
    _shot(page, shots, "overview")

    # Search runs in the store: the needles sit behind 31 newer jobs (page 2).
    page.fill("#search", "kind:needle")
    expect(page.locator("#jobs tr.row")).to_have_count(5)
    page.fill("#search", needles[0][-12:])
    expect(page.locator("#jobs tr.row")).to_have_count(1)
    expect(page.locator(f'#jobs tr[data-job="{needles[0]}"]')).to_be_visible()
    page.fill("#search", "kind:no-such-kind")
    expect(page.locator("#jobs tr.row")).to_have_count(0)
    expect(page.locator("#jobs")).to_contain_text("no job matches")
    page.fill("#search", "")
    expect(page.locator("#jobs tr.row")).to_have_count(25)

    # The dead letter's drawer: payload, error, traceback, timeline, side effects.
    page.locator(f'#dlq tr[data-job="{dead}"] td.link').click()
    drawer = page.get_by_test_id("drawer")
    expect(drawer).to_be_visible()
    expect(page.get_by_test_id("payload")).to_contain_text('"order": 42')
    expect(page.get_by_test_id("error")).to_have_text("RuntimeError: downstream API refused the request")
    expect(page.get_by_test_id("traceback")).to_contain_text("Traceback (most recent call last)")
    expect(page.get_by_test_id("traceback")).to_contain_text("in _boom")
    events = page.get_by_test_id("events")
    expect(events.locator("li")).to_have_count(3)
    expect(events.locator('li[data-event="claimed"]')).to_contain_text("claimed and started")
    expect(events.locator('li[data-event="claimed"]')).to_contain_text("running")
    expect(events.locator('li[data-event="committed"]')).to_contain_text("dead letter")
    for stamp in events.locator("time").all_inner_texts():
        assert STAMP.fullmatch(stamp), stamp
    expect(events.locator(".dur")).to_have_count(2)
    expect(page.get_by_test_id("durations")).to_contain_text("waited")
    expect(page.get_by_test_id("durations")).to_contain_text("last attempt ran")
    expect(page.get_by_test_id("effects")).to_contain_text("notify-customer")
    expect(page.get_by_test_id("effects")).to_contain_text("committed")
    _shot(page, shots, "job-drawer", full_page=False)
    page.click("#d-close")

    # The open drawer follows the job: cancelled elsewhere, it shows so by itself.
    page.locator(f'#jobs tr[data-job="{fresh}"]').click()
    expect(page.locator("#d-title .badge")).to_have_text("ready")
    expect(page.get_by_test_id("payload")).to_contain_text('"hello": "world"')
    h.dispatcher().cancel(fresh, "acme", "cancelled by the CLI")
    expect(page.locator("#d-title .badge")).to_have_text("cancelled", timeout=15_000)
    expect(page.locator("#d-job")).to_contain_text("cancelled by the CLI")
    page.click("#d-close")

    # Cancel asks first; "Keep" changes nothing.
    target = needles[1]
    page.fill("#search", f"id:{target}")
    page.locator(f'#jobs tr[data-job="{target}"]').click()
    page.click('#d-actions [data-action="cancel"]')
    expect(page.get_by_test_id("confirm")).to_be_visible()
    expect(page.locator("#c-title")).to_have_text("Cancel this job?")
    _shot(page, shots, "confirm-cancel", full_page=False)
    page.click("#c-no")
    expect(page.get_by_test_id("confirm")).to_be_hidden()
    assert h.store.get(target, "acme").status is Status.READY
    page.click('#d-actions [data-action="cancel"]')
    page.click("#c-yes")
    expect(page.locator("#d-title .badge")).to_have_text("cancelled")
    assert h.store.get(target, "acme").status is Status.CANCELLED
    page.click("#d-close")
    page.fill("#search", "")

    # Bulk replay of the DLQ, behind a confirmation.
    for job_id in bulk[:2]:
        page.locator(f'#dlq input[data-job="{job_id}"]').check()
    page.click("#dlq-replay")
    expect(page.locator("#c-title")).to_have_text("Replay 2 dead-lettered jobs?")
    _shot(page, shots, "confirm-bulk-replay", full_page=False)
    page.click("#c-yes")
    expect(page.locator("#notice")).to_contain_text("Replayed 2 jobs")
    expect(page.locator("#dlq tr[data-job]")).to_have_count(2)
    assert [h.store.get(j, "acme").status for j in bulk[:2]] == [Status.READY, Status.READY]

    # Bulk purge of what is left: select all, dismiss once, then confirm.
    page.locator("#dlq-all").check()
    page.click("#dlq-purge")
    expect(page.locator("#c-title")).to_have_text("Purge 2 dead-lettered jobs?")
    page.click("#c-no")
    assert h.store.get(bulk[2], "acme").status is Status.DEAD_LETTER
    page.click("#dlq-purge")
    page.click("#c-yes")
    expect(page.locator("#notice")).to_contain_text("Purged 2 jobs")
    expect(page.locator("#dlq")).to_contain_text("nothing dead-lettered")
    for job_id in (bulk[2], dead):
        with pytest.raises(JobNotFound):
            h.store.get(job_id, "acme")
    assert h.store.history(bulk[0], "acme")["events"][-1]["event"] == "replayed"

    # A phone: the same views, no sideways scrolling, a page one can scroll through.
    late = _dead_letters(h, "acme", 1)[0]
    page.set_viewport_size(PHONE)
    page.reload()
    expect(page.get_by_test_id("tenant")).to_have_text("tenant acme")  # the token survives a reload
    expect(page.locator("#jobs tr.row")).to_have_count(25)
    width, height = _page_size(page)
    assert width <= PHONE["width"], width
    assert height <= PHONE_SCREENS * PHONE["height"], height
    _shot(page, shots, "overview")
    page.fill("#search", bulk[0])
    page.locator(f'#jobs tr[data-job="{bulk[0]}"]').click()
    expect(page.get_by_test_id("traceback")).to_contain_text("ConnectionError: upstream reset #0")
    assert _page_size(page)[0] <= PHONE["width"]
    _shot(page, shots, "job-drawer", full_page=False)
    page.click("#d-close")
    page.fill("#search", needles[2])
    page.locator(f'#jobs tr[data-job="{needles[2]}"]').click()
    page.click('#d-actions [data-action="cancel"]')
    expect(page.get_by_test_id("confirm")).to_be_visible()
    _shot(page, shots, "confirm-cancel", full_page=False)
    page.click("#c-no")
    page.click("#d-close")
    page.locator(f'#dlq input[data-job="{late}"]').check()
    page.click("#dlq-replay")
    expect(page.locator("#c-title")).to_have_text("Replay 1 dead-lettered job?")
    _shot(page, shots, "confirm-bulk-replay", full_page=False)
    page.click("#c-no")
    assert h.store.get(late, "acme").status is Status.DEAD_LETTER
    assert errors == []


def test_operator_sees_depth_of_every_tenant(tmp_path: Path, page: Page, shots: Path) -> None:
    h = sqlite_harness(tmp_path)
    gw = start_gateway(tmp_path / "data", "--no-auth")  # loopback: the caller is the operator
    try:
        d = h.dispatcher()
        for tenant, kind, n in (("acme", "mail", 3), ("globex", "mail", 2), ("globex", "chat", 4)):
            for _ in range(n):
                d.submit(Submission(kind=kind, tenant=tenant))
        page.goto(gw.url + "/")
        expect(page.get_by_test_id("tenant")).to_have_text("operator (all tenants)")
        expect(page.locator('#depth-tenants li[data-name="globex"] .n')).to_have_text("6")
        expect(page.locator('#depth-tenants li[data-name="acme"] .n')).to_have_text("3")
        expect(page.locator('#depth-kinds li[data-name="mail"] .n')).to_have_text("5")
        expect(page.locator('#depth-kinds li[data-name="chat"] .n')).to_have_text("4")
        expect(page.get_by_test_id("activity-sum")).to_have_text("9 accepted, 0 finished, 9 open now")
        _shot(page, shots, "operator")
        page.set_viewport_size(PHONE)
        page.reload()
        expect(page.locator('#depth-tenants li[data-name="globex"] .n')).to_have_text("6")
        assert _page_size(page)[0] <= PHONE["width"]
        _shot(page, shots, "operator")
    finally:
        gw.stop()
        h.close()


def test_dashboard_routes_authenticate_validate_and_change_nothing_on_refusal(
    setup: tuple[Gateway, Harness],
) -> None:
    gw, h = setup
    mine = _dead_letters(h, "acme", 2)
    theirs = _dead_letters(h, "globex", 1)[0]
    live = h.dispatcher().submit(Submission(kind="echo", tenant="acme")).job_id
    for method, path in (
        ("GET", "/api/depth"),
        ("GET", "/api/activity"),
        ("POST", "/v1/dlq/replay"),
        ("POST", "/v1/dlq/purge"),
    ):
        r = httpx.request(method, gw.url + path, json={"job_ids": mine})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, r.text)
    with gw.client("acme") as api:
        for query in ("window_s=10", "bucket_s=1", "window_s=3600&bucket_s=7", "window_s=86400&bucket_s=5"):
            r = api.get(f"/api/activity?{query}")
            assert r.status_code == 422 and r.json()["error"] == "invalid_request", (query, r.text)
        act = api.get("/api/activity?window_s=600&bucket_s=30")
        assert act.status_code == 200 and len(act.json()["points"]) == 20
        assert act.headers["Cache-Control"] == "no-store"
        assert sum(p["dead_letter"] for p in act.json()["points"]) == 2  # the tenant's own only
        depth = api.get("/api/depth").json()
        assert depth["rows"] == [{"tenant": "acme", "kind": "echo", "status": "ready", "count": 1}]

        for action in ("replay", "purge"):
            for body, status in (
                ({"job_ids": []}, 422),
                ({"job_ids": ["has space"]}, 422),
                ({"job_ids": mine * 300}, 422),
                ({"job_ids": mine, "extra": 1}, 422),
                ({"job_ids": [*mine, theirs]}, 404),  # another tenant's is missing, like an unknown one
                ({"job_ids": [*mine, "no-such-job"]}, 404),
                ({"job_ids": [*mine, live]}, 409),
            ):
                r = api.post(f"/v1/dlq/{action}", json=body)
                assert r.status_code == status, (action, body, r.text)
        # Nothing of those refusals changed anything.
        assert [h.store.get(j, "acme").status for j in mine] == [Status.DEAD_LETTER] * 2
        assert h.store.get(theirs, "globex").status is Status.DEAD_LETTER

        r = api.post("/v1/dlq/replay", json={"job_ids": [mine[0], mine[0]]})
        assert r.status_code == 200 and [j["status"] for j in r.json()["jobs"]] == ["ready"]
        r = api.post("/v1/dlq/purge", json={"job_ids": [mine[1]]})
        assert r.status_code == 200 and r.json() == {"purged": [mine[1]]}
        assert api.get(f"/v1/jobs/{mine[1]}").status_code == 404
    assert h.store.get(mine[0], "acme").status is Status.READY
    assert h.store.get(theirs, "globex").status is Status.DEAD_LETTER


def test_dashboard_is_served_with_a_strict_content_security_policy(setup: tuple[Gateway, Harness]) -> None:
    gw, _ = setup
    for path in ("/", "/dashboard/app.js", "/dashboard/chart.js", "/dashboard/drawer.js", "/dashboard/app.css"):
        r = httpx.get(gw.url + path)
        assert r.status_code == 200
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert httpx.get(gw.url + "/dashboard/../auth.py").status_code == 404
    assert httpx.get(gw.url + "/dashboard/services.py").status_code == 404
