"""A whole intake deployment per test, on SQLite or PostgreSQL: installations
made through the CLI, a real gateway process, real worker processes and a
fake provider API on loopback whose calls can be held in flight."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentdispatch.intake.admit import job_id_of
from backends import fresh_pg_database
from e2e.gatewayproc import Gateway, cli_env, start_gateway
from intake.fakeapi import OK, Answer, body_of, serve
from intake.kit import KEY, TG_BOT, Installations, cli, env_for, install_all, migrate, post_tg, tg_update


@dataclass
class Provider:
    """The fake Bot API: every call is recorded, then waits while ``held`` is clear."""

    url: str = ""
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: threading.Event = field(default_factory=threading.Event)

    def snapshot(self) -> list[tuple[str, str, Any]]:
        with self.lock:
            return list(self.calls)

    def wait_calls(self, n: int, timeout: float = 30.0) -> list[tuple[str, str, Any]]:
        return wait_for(lambda: len(got := self.snapshot()) >= n and got, f"{n} provider call(s)", timeout)


@contextmanager
def provider() -> Iterator[Provider]:
    prov = Provider()
    prov.released.set()

    def answer(path: str, headers: dict[str, str], raw: bytes) -> Answer:
        with prov.lock:
            prov.calls.append((path, headers.get("idempotency-key", ""), body_of(raw)))
        prov.released.wait(30)  # the reply call stays in flight until the test lets it go
        return OK

    try:
        with serve(answer) as prov.url:
            yield prov
    finally:
        prov.released.set()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy (deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Site:
    backend: str
    data: Path
    env: dict[str, str]
    prov: Provider
    inst: Installations
    uri: str = ""
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)

    def cli(self, *args: str, **env: str) -> str:
        return cli(self.data, *args, **{**self.env, **env})

    def cli_fails(self, *args: str, **env: str) -> str:
        """Run a CLI command that must fail; its stderr."""
        out = subprocess.run(
            [sys.executable, "-m", "agentdispatch", *args],
            env=env_for(self.data, {**self.env, **env}),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0, out.stdout
        return out.stderr

    def gateway(self, *args: str, **env: str) -> Gateway:
        gw = start_gateway(self.data, *args, AGENT_DISPATCH_INTAKE_KEY=KEY, **{**self.env, **env})
        self.gateways.append(gw)
        return gw

    def worker(self, **env: str) -> subprocess.Popen[str]:
        """A real ``agentdispatch worker`` process (the built-in intake_turn handler)."""
        log = (self.data / f"worker{len(self.procs)}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "worker", "-w", "2"],
            env=cli_env(self.data, AGENT_DISPATCH_INTAKE_KEY=KEY, **{**self.env, **env}),
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def client(self, gw: Gateway, tenant: str) -> httpx.Client:
        """A client with a bearer token of ``tenant``, minted in this site's store."""
        token = json.loads(self.cli("token", "create", "--tenant", tenant, "--json"))["token"]
        return httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def stop_worker(self, proc: subprocess.Popen[str], *, after: list[str]) -> None:
        """Stop ``proc`` (SIGTERM, a clean exit) once the items ``after`` are terminal."""
        self.wait_terminal(*after)
        proc.terminate()
        assert proc.wait(timeout=30) == 0

    def rows(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """Plain SQL as an operator runs it (``?`` placeholders on both databases)."""
        if self.backend == "postgres":
            import psycopg
            from psycopg.rows import dict_row

            with psycopg.connect(self.uri, row_factory=dict_row) as conn:
                return list(conn.execute(sql.replace("?", "%s"), args).fetchall())  # type: ignore[arg-type]
        conn = sqlite3.connect(self.data / "agent_dispatch_queue.db", timeout=30)
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute(sql, args).fetchall()]
        finally:
            conn.close()

    def item(self, job_id: str) -> dict[str, Any]:
        got = self.rows("SELECT * FROM work_items WHERE id = ?", job_id)
        assert got, f"no work item {job_id}"
        return got[0]

    def receipt(self, job_id: str) -> dict[str, Any]:
        got = self.rows("SELECT * FROM intake_receipts WHERE job_id = ?", job_id)
        assert got, f"no receipt for {job_id}"
        return got[0]

    def wait_terminal(self, *job_ids: str, timeout: float = 60.0) -> None:
        done = ("succeeded", "failed", "cancelled", "dead_letter")

        def check() -> bool:
            return all(self.item(j)["status"] in done for j in job_ids)

        try:
            wait_for(check, f"{job_ids} to finish", timeout)
        except AssertionError:
            logs = "\n".join((self.data / f"worker{i}.log").read_text()[-3000:] for i in range(len(self.procs)))
            raise AssertionError(f"{[self.item(j)['status'] for j in job_ids]}\n{logs}") from None

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for gw in self.gateways:
            gw.stop()


def tg_job(update_id: int) -> str:
    """The WorkItem id of a Telegram update."""
    return job_id_of("telegram", f"{TG_BOT}:{update_id}")


def send(c: httpx.Client, update_id: int, text: str = "hi", **kw: Any) -> httpx.Response:
    return post_tg(c, tg_update(update_id, text, **kw))


@contextmanager
def site(tmp: Path, backend: str) -> Iterator[Site]:
    """Installations on a fresh SQLite file or PostgreSQL database, a fake provider."""
    cleanup: list[Callable[[], None]] = []
    env: dict[str, str] = {}
    uri = ""
    data = tmp / "data"
    if backend == "postgres":
        uri = fresh_pg_database(cleanup)
        env = {"STATE_DB_URI": uri, "TASK_QUEUE_BACKEND": "postgres"}
        migrate(data, **env)
    try:
        with provider() as prov:
            inst = install_all(data, api_base=prov.url, **env)
            s = Site(backend, data, env, prov, inst, uri)
            try:
                yield s
            finally:
                s.stop()
    finally:
        for fn in cleanup:
            fn()
