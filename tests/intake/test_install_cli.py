"""The ``agentdispatch intake`` commands make the deployment the other intake
tests make in-process (``install_all``), so those tests cover what an
operator's CLI calls produce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentdispatch.factory import open_intake_store
from agentdispatch.intake import admin
from agentdispatch.intake.credentials import open_credentials
from intake.kit import KEY, db, install_all, install_all_via_cli, open_store

#: Columns that hold the time of the write, not what was written.
_WHEN = ("created_at", "updated_at")


def _deployment(data: Path) -> dict[str, Any]:
    store = open_store(data)
    try:
        istore = open_intake_store(store)
        listed = {what: admin.listing(istore, what) for what in ("installations", "agents", "routes")}
    finally:
        store.close()
    with db(data) as conn:
        sealed = conn.execute("SELECT id, credentials FROM intake_installations").fetchall()
    creds = {r["id"]: open_credentials(KEY, r["id"], r["credentials"]) for r in sealed}
    rows = {what: [{k: v for k, v in r.items() if k not in _WHEN} for r in got] for what, got in listed.items()}
    return {**rows, "credentials": creds}


def test_cli_makes_what_the_in_process_helper_makes(tmp_path: Path) -> None:
    by_cli = install_all_via_cli(tmp_path / "cli", api_base="http://127.0.0.1:9")
    in_process = install_all(tmp_path / "api", api_base="http://127.0.0.1:9")
    assert by_cli == in_process
    made = _deployment(tmp_path / "cli")
    assert made == _deployment(tmp_path / "api")
    assert len(made["installations"]) == 3 and len(made["routes"]) == 3
    assert made["credentials"][by_cli.telegram]["bot_token"] == "7001:tok"
