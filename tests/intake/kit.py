"""Helpers of the intake tests: a real gateway subprocess with installations
made through the functions behind the CLI (or the real CLI), and
provider-side signing."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from slack_sdk.signature import SignatureVerifier
from twilio.request_validator import RequestValidator

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.factory import open_intake_store
from agentdispatch.intake import admin
from agentdispatch.intake.base import IntakeStore
from agentdispatch.settings import SQLITE_FILE
from agentdispatch.stores.base import Store
from backends import fresh_pg_database
from e2e.gatewayproc import Gateway, cli_env, start_gateway

KEY = "11" * 32
SLACK_SECRET = "slack-signing-secret"
TG_SECRET = "tg-secret_TOKEN-1"
TWILIO_TOKEN = "twilio-auth-token"
PUBLIC = "https://hooks.example.test"
APP, TEAM, BOT_USER = "A0APP", "T0TEAM", "U0BOT"
TG_BOT = "7001"
ACCOUNT, NUMBER = "AC0001", "+15550001"


def env_for(data_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess environment (extra wins, so PostgreSQL can be chosen)."""
    return {**cli_env(data_dir), "AGENT_DISPATCH_INTAKE_KEY": KEY, **(extra or {})}


def cli(data_dir: Path, *args: str, stdin: str | None = None, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "agentdispatch", *args],
        env=env_for(data_dir, env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@dataclass
class Installations:
    slack: str
    telegram: str
    twilio: str


def install_all(data_dir: Path, api_base: str = "", **env: str) -> Installations:
    """One installation per connector, a default agent and catch-all routes,
    made in this process through the functions the CLI commands call: seven
    CLI processes per deployment were a large share of the intake tests' CPU.
    :func:`install_all_via_cli` makes the same ones through the real commands."""
    store = open_store(data_dir, **env)
    try:
        istore = open_intake_store(store)
        common = {"tenant": "acme", "master_key": KEY, "api_base": api_base}
        s = admin.install(istore, connector="slack", external_id=f"{APP}:{TEAM}", route_key=APP,
                          secrets={"signing_secret": SLACK_SECRET, "bot_token": "xoxb-1"},
                          bot_user_id=BOT_USER, **common)  # fmt: skip
        t = admin.install(istore, connector="telegram", external_id=TG_BOT, route_key=TG_BOT,
                          secrets={"secret_token": TG_SECRET, "bot_token": f"{TG_BOT}:tok"},
                          bot_user_id="helperbot", **common)  # fmt: skip
        w = admin.install(istore, connector="twilio", external_id=f"{ACCOUNT}:{NUMBER}", route_key=ACCOUNT,
                          secrets={"auth_token": TWILIO_TOKEN}, public_url=PUBLIC, **common)  # fmt: skip
        admin.set_agent(istore, "helper", enabled=True)
        for inst in (s, t, w):
            admin.set_route(istore, inst, "*", "helper")
    finally:
        store.close()
    return Installations(s, t, w)


def open_store(data_dir: Path, **env: str) -> Store:
    """The store a CLI process with ``env`` opens: PostgreSQL when
    ``STATE_DB_URI`` is given, else the data dir's SQLite file, which
    migrates itself as the CLI's does."""
    uri = env.get("STATE_DB_URI")
    if uri:
        return PostgresStore(uri, pool_size=1)
    store = SqliteStore(data_dir / SQLITE_FILE)
    store.migrate()
    return store


def migrate(data_dir: Path, **env: str) -> None:
    """What ``agentdispatch migrate`` does, in this process (its command is
    tested in tests/e2e)."""
    store = open_store(data_dir, **env)
    try:
        store.migrate()
    finally:
        store.close()


def install_all_via_cli(data_dir: Path, api_base: str = "", **env: str) -> Installations:
    """What :func:`install_all` makes, through ``agentdispatch intake`` commands."""
    extra = ["--api-base", api_base] if api_base else []
    s = cli(data_dir, "intake", "install", "slack", "--tenant", "acme", "--app-id", APP, "--team-id", TEAM,
            "--bot-user-id", BOT_USER, *extra, "--credentials-stdin",
            stdin=json.dumps({"signing_secret": SLACK_SECRET, "bot_token": "xoxb-1"}), **env)  # fmt: skip
    t = cli(data_dir, "intake", "install", "telegram", "--tenant", "acme", "--bot-id", TG_BOT,
            "--bot-user-id", "helperbot", *extra, "--credentials-stdin",
            stdin=json.dumps({"secret_token": TG_SECRET, "bot_token": f"{TG_BOT}:tok"}), **env)  # fmt: skip
    w = cli(data_dir, "intake", "install", "twilio", "--tenant", "acme", "--account-sid", ACCOUNT, "--number", NUMBER,
            "--public-url", PUBLIC, *extra, "--credentials-stdin",
            stdin=json.dumps({"auth_token": TWILIO_TOKEN}), **env)  # fmt: skip
    cli(data_dir, "intake", "agent", "add", "helper", **env)
    for inst in (s, t, w):
        cli(data_dir, "intake", "route", "set", inst, "*", "helper", **env)
    return Installations(s, t, w)


def gateway(data_dir: Path, **env: str) -> Gateway:
    """A real ``agentdispatch gateway`` subprocess (auth off, loopback)."""
    return start_gateway(data_dir, "--no-auth", AGENT_DISPATCH_INTAKE_KEY=KEY, **env)


def slack_event(event_id: str, text: str = "<@U0BOT> hello", *, channel: str = "C1", user: str = "U1",
                etype: str = "app_mention", ts: str = "1700000000.000100", **event: Any) -> bytes:  # fmt: skip
    doc = {
        "type": "event_callback",
        "api_app_id": APP,
        "team_id": TEAM,
        "event_id": event_id,
        "event_time": 1700000000,
        "event": {"type": etype, "channel": channel, "user": user, "text": text, "ts": ts, **event},
    }
    return json.dumps(doc).encode()


def slack_sign(secret: str, ts: str, body: bytes) -> str:
    """What Slack sends, as slack_sdk computes it."""
    return str(SignatureVerifier(secret).generate_signature(timestamp=ts, body=body))


def twilio_sign(token: str, url: str, params: list[tuple[str, str]] | None = None) -> str:
    """What Twilio sends, as the twilio library computes it."""
    return str(RequestValidator(token).compute_signature(url, dict(params or [])))


def slack_headers(body: bytes, *, secret: str = SLACK_SECRET, at: float | None = None) -> dict[str, str]:
    ts = str(int(time.time() if at is None else at))
    return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": slack_sign(secret, ts, body),
            "Content-Type": "application/json"}  # fmt: skip


def post_slack(c: httpx.Client, body: bytes, **headers: str) -> httpx.Response:
    return c.post(f"/intake/slack/{APP}", content=body, headers={**slack_headers(body), **headers})


def tg_update(update_id: int, text: str = "hi", *, chat: int = 42, user: int = 9, private: bool = True) -> bytes:
    msg = {"message_id": update_id * 10, "date": 1700000000, "text": text, "from": {"id": user},
           "chat": {"id": chat, "type": "private" if private else "group"}}  # fmt: skip
    return json.dumps({"update_id": update_id, "message": msg}).encode()


def post_tg(c: httpx.Client, body: bytes, secret: str = TG_SECRET) -> httpx.Response:
    return c.post(f"/intake/telegram/{TG_BOT}", content=body,
                  headers={"X-Telegram-Bot-Api-Secret-Token": secret, "Content-Type": "application/json"})  # fmt: skip


def sms_params(sid: str, body: str = "hello", sender: str = "+15559999") -> list[tuple[str, str]]:
    return [("AccountSid", ACCOUNT), ("MessageSid", sid), ("From", sender), ("To", NUMBER), ("Body", body)]


def post_twilio(c: httpx.Client, path: str, params: list[tuple[str, str]], *, query: str = "",
                token: str = TWILIO_TOKEN, host: str | None = None) -> httpx.Response:  # fmt: skip
    url = f"{PUBLIC}/intake/twilio/{ACCOUNT}/{path}" + (f"?{query}" if query else "")
    headers = {"X-Twilio-Signature": twilio_sign(token, url, params)}
    if host:
        headers["Host"] = host
    target = f"/intake/twilio/{ACCOUNT}/{path}" + (f"?{query}" if query else "")
    return c.post(target, data=dict(params), headers=headers)


def db(data_dir: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(data_dir / "agent_dispatch_queue.db", timeout=30)
    conn.row_factory = sqlite3.Row
    return conn


def count(data_dir: Path, sql: str, *args: Any) -> int:
    with db(data_dir) as conn:
        return int(conn.execute(sql, args).fetchone()[0])


def install_telegram_bot(store: Store, tmp_path: Path) -> tuple[IntakeStore, dict[str, Any]]:
    """Bot ``7`` of tenant ``acme`` installed in ``store``'s intake store, every
    conversation routed to the enabled agent ``helper``: the store and the row."""
    creds = tmp_path / "creds.json"
    creds.write_text('{"secret_token": "s", "bot_token": "7:t"}')
    ist = open_intake_store(store)
    inst_id = admin.install(ist, connector="telegram", external_id="7", route_key="7", tenant="acme",
                            master_key=None, reference=f"file:{creds}")  # fmt: skip
    admin.set_agent(ist, "helper", enabled=True)
    admin.set_route(ist, inst_id, "*", "helper")
    inst = ist.installation(inst_id)
    assert inst is not None
    return ist, inst


@contextmanager
def pg_gateway_on(data: Path, commit_timeout_s: str) -> Iterator[tuple[Gateway, str]]:
    """A gateway with every connector installed, on a fresh PostgreSQL
    database (dropped after): the gateway and the database's URI."""
    cleanup: list[Callable[[], None]] = []
    uri = fresh_pg_database(cleanup)
    env = {"STATE_DB_URI": uri, "TASK_QUEUE_BACKEND": "postgres"}
    migrate(data, **env)
    install_all(data, **env)
    gw = gateway(data, AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S=commit_timeout_s, **env)
    try:
        yield gw, uri
    finally:
        gw.stop()
        for fn in cleanup:
            fn()
