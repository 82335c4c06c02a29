"""In-process worker harness for intake turns: a real SQLite store, a real
worker, and a local recording server standing in for the provider APIs."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentdispatch.factory import open_intake_store
from agentdispatch.handlers import Registry
from agentdispatch.intake import admin
from agentdispatch.intake.admit import Incoming, admit, job_id_of
from agentdispatch.intake.answers import ok
from agentdispatch.intake.base import IntakeStore
from agentdispatch.intake.envelope import IntakeEnvelope
from agentdispatch.intake.handler import build_handler
from agentdispatch.intake.processor import Context, Respond
from backends import Harness
from intake.fakeapi import OK, Answer, body_of, serve


@dataclass
class Recorder:
    """Every provider API call: (path, idempotency key, body)."""

    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""


@contextmanager
def recording_server() -> Iterator[Recorder]:
    rec = Recorder()

    def answer(path: str, headers: dict[str, str], raw: bytes) -> Answer:
        with rec.lock:
            rec.calls.append((path, headers.get("idempotency-key", ""), body_of(raw)))
        return OK

    with serve(answer) as rec.url:
        yield rec


@dataclass
class Rig:
    h: Harness
    ist: IntakeStore
    inst: dict[str, Any]
    rec: Recorder
    seq: int = 0

    def dm(self, text: str, *, sender: str = "U1", conversation: str = "D1", **kw: Any) -> str:
        """Deliver a Slack message (DM by default) through the real admission transaction."""
        self.seq += 1
        env = IntakeEnvelope(
            connector="slack", installation=self.inst["id"], source_id=f"A:T:Ev{self.seq}",
            conversation=conversation, sender=sender, text=text, channel=conversation,
            message_key=kw.pop("message_key", f"{conversation}:{self.seq}"), is_dm=kw.pop("is_dm", True),
            thread=f"{self.seq}.0", **kw,
        )  # fmt: skip
        inc = Incoming("slack", env.source_id, env.to_json().encode(), ok(), self.inst, envelope=env)
        answer = admit(self.ist, self.h.dispatcher(), inc, abandoned=threading.Event())
        assert answer.status == 200
        return job_id_of("slack", env.source_id)

    @contextmanager
    def sql(self) -> Iterator[sqlite3.Connection]:
        """A transaction on the rig's SQLite file, for test set-up."""
        conn = sqlite3.connect(self.h.settings.sqlite_path, timeout=30)
        try:
            with conn:
                yield conn
        finally:
            conn.close()

    def receipt(self, job_id: str) -> dict[str, Any]:
        row = self.ist.receipt(job_id)
        assert row is not None
        return row

    def wait(self, *job_ids: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.h.store.get(j, None).status.terminal for j in job_ids):
                return
            time.sleep(0.05)
        raise AssertionError(f"not finished: {[(j, self.h.store.get(j, None).status) for j in job_ids]}")

    def replies(self) -> list[tuple[str, str, Any]]:
        with self.rec.lock:
            return list(self.rec.calls)


def make_rig(h: Harness, rec: Recorder, tmp: Path) -> Rig:
    creds = tmp / "creds.json"
    creds.write_text(json.dumps({"signing_secret": "s", "bot_token": "xoxb-test"}))
    ist = open_intake_store(h.store)
    ref = f"file:{creds}"
    inst_id = admin.install(ist, connector="slack", external_id="A:T", route_key="A", tenant="acme",
                            master_key=None, reference=ref, bot_user_id="U0BOT", api_base=rec.url)  # fmt: skip
    admin.set_agent(ist, "helper", enabled=True)
    admin.set_route(ist, inst_id, "*", "helper")
    inst = ist.installation(inst_id)
    assert inst is not None
    return Rig(h, ist, inst, rec)


def registry(h: Harness, respond: Respond | None = None) -> Registry:
    reg = Registry()

    def echo(ctx: Context) -> str:
        return "re: " + " + ".join(ctx.texts)

    reg.add("intake_turn", build_handler(respond or echo, settings=h.settings))
    return reg
