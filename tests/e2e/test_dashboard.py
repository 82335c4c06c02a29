"""The dashboard in real headless Chromium against a real gateway: it loads,
shows a submitted job and a job's history, and its Replay button moves a
dead-lettered job back to ``ready``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from agentdispatch.dispatch import Submission
from agentdispatch.handlers import Registry
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
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


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
def page() -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 950})
        finally:
            browser.close()


def _boom(turn: Any, guard: Any) -> None:
    guard.side_effect("notify-customer", lambda: {"sent": True})
    raise RuntimeError("downstream API refused the request")


def _dead_letter_via_worker(h: Harness, tenant: str) -> str:
    """A real worker runs a handler that always raises; max attempts is 1."""
    handle = h.dispatcher().submit(Submission(kind="boom", tenant=tenant, session_id="support-42"))
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


def test_dashboard_shows_jobs_and_replays_the_dead_letter_queue(setup: tuple[Gateway, Harness], page: Page) -> None:
    gw, h = setup
    dead = _dead_letter_via_worker(h, "acme")
    with gw.client("acme") as api:
        fresh = api.post("/v1/jobs", json={"kind": "echo", "payload": {"hello": "world"}}).json()["job_id"]
        delayed = api.post("/v1/jobs", json={"kind": "other", "delay_s": 7200}).json()["job_id"]
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(gw.url + "/")
    expect(page.locator("#notice")).to_contain_text("bearer token")  # no token yet: 401 explained
    page.fill("#token", gw.token("acme"))
    page.click("#login button[type=submit]")

    expect(page.get_by_test_id("tenant")).to_have_text("tenant acme")
    job_row = page.locator(f'#jobs tr[data-job="{fresh}"]')
    expect(job_row).to_be_visible()
    expect(job_row.locator(".badge")).to_have_text("ready")
    expect(page.locator('#status-chips [data-status="dead_letter"] .n')).to_have_text("1")
    expect(page.get_by_test_id("depth-backend")).not_to_have_text("\u2013")

    # Search narrows the table to the matching job.
    page.fill("#search", "echo")
    expect(page.locator("#jobs tr.row")).to_have_count(1)
    # Prefixed filters search the store: the delayed job shows when it starts.
    page.fill("#search", f"kind:other id:{delayed[-12:]}")
    expect(page.locator("#jobs tr.row")).to_have_count(1)
    expect(page.locator(f'#jobs tr[data-job="{delayed}"]')).to_contain_text("starts")
    page.fill("#search", "kind:no-such-kind")
    expect(page.locator("#jobs tr.row")).to_have_count(0)
    page.fill("#search", "")

    # The dead letter's history: attempts, leases, the side-effect ledger, the outcome.
    page.locator(f'#dlq tr[data-job="{dead}"] td.link').click()
    drawer = page.get_by_test_id("drawer")
    expect(drawer).to_be_visible()
    expect(page.locator("#d-effects")).to_contain_text("notify-customer")
    expect(page.locator("#d-effects")).to_contain_text("committed")
    expect(page.locator("#d-outcome")).to_contain_text("downstream API refused")
    expect(page.get_by_test_id("events")).to_contain_text("dead letter")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-history.png"), full_page=True)
    page.click("#d-close")

    page.locator(f'#dlq button[data-action="replay"][data-job="{dead}"]').click()
    expect(page.locator("#notice")).to_contain_text(f"Replayed {dead}: now ready")
    expect(page.locator(f'#dlq tr[data-job="{dead}"]')).to_have_count(0)
    expect(page.locator(f'#jobs tr[data-job="{dead}"] .badge')).to_have_text("ready")
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    assert h.store.get(dead, "acme").status is Status.READY
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    assert errors == []


def test_dashboard_is_served_with_a_strict_content_security_policy(setup: tuple[Gateway, Harness]) -> None:
    import httpx

    gw, _ = setup
    for path in ("/", "/dashboard/app.js", "/dashboard/app.css"):
        r = httpx.get(gw.url + path)
        assert r.status_code == 200
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert httpx.get(gw.url + "/dashboard/../auth.py").status_code == 404
    assert httpx.get(gw.url + "/dashboard/services.py").status_code == 404
