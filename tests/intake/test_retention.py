"""Retention in a real gateway process: terminal intake bodies older than 7 days
are scrubbed without an operator, and a late duplicate is still recognised."""

from __future__ import annotations

import time
from pathlib import Path

from intake.kit import cli, count, db, gateway, install_all, post_slack, slack_event

SCRUBBED = "SELECT count(*) FROM intake_receipts WHERE scrubbed_at IS NOT NULL AND raw IS NULL"
AGED = "UPDATE intake_receipts SET received_at = received_at - 8 * 86400 WHERE source_id LIKE ?"


def _receipts(data: Path) -> dict[str, dict[str, object]]:
    with db(data) as conn:
        rows = conn.execute("SELECT source_id, job_id, tenant, raw, envelope FROM intake_receipts").fetchall()
    return {str(r["source_id"]).rsplit(":", 1)[-1]: dict(r) for r in rows}


def test_the_gateway_scrubs_expired_terminal_bodies_by_itself(tmp_path: Path) -> None:
    data = tmp_path / "data"
    install_all(data)
    gw = gateway(data, AGENT_DISPATCH_INTAKE_SCRUB_EVERY_S="0.5")
    try:
        with gw.client() as c:
            old, fresh = slack_event("EvOld"), slack_event("EvFresh")
            assert post_slack(c, old).status_code == 200
            assert post_slack(c, fresh).status_code == 200
            before = _receipts(data)
            for r in before.values():  # terminal, both of them
                cli(data, "cancel", str(r["job_id"]), "--tenant", str(r["tenant"]))
            with db(data) as conn:  # only one of them is past the retention
                conn.execute(AGED, ("%:EvOld",))
            deadline = time.monotonic() + 15
            while count(data, SCRUBBED) < 1:
                assert time.monotonic() < deadline, "the gateway never scrubbed the expired body"
                time.sleep(0.2)
            after = _receipts(data)
            # Body gone; identity, reference and answer stay.
            assert after["EvOld"]["raw"] is None and after["EvOld"]["envelope"] is None
            assert after["EvOld"]["job_id"] == before["EvOld"]["job_id"]
            assert after["EvFresh"]["raw"] is not None and after["EvFresh"]["envelope"] is not None
            # A late duplicate of the scrubbed delivery is recognised: 200, no new item.
            items = count(data, "SELECT count(*) FROM work_items")
            assert post_slack(c, old, **{"X-Slack-Retry-Num": "1"}).status_code == 200
            assert count(data, "SELECT count(*) FROM work_items") == items
            assert count(data, "SELECT count(*) FROM intake_receipts") == 2
    finally:
        gw.stop()
