"""Backend harnesses for the contract suite and integration tests.

Each backend registers a builder in ``BUILDERS``; the contract suite is
parametrized over ``CONTRACT_BACKENDS`` (the env var AGENTDISPATCH_TEST_BACKENDS,
comma-separated, narrows it). A builder returns a :class:`Harness` on a fresh,
empty store.
"""

from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentdispatch.dispatch import Dispatcher
from agentdispatch.factory import open_backends
from agentdispatch.handlers import Registry
from agentdispatch.settings import Settings, load_settings
from agentdispatch.stores.base import Store
from agentdispatch.transports.base import Transport
from agentdispatch.worker import Worker, WorkerOptions


@dataclass
class Harness:
    """A store + transport on a fresh database, with helpers for tests."""

    name: str
    settings: Settings
    store: Store
    transport: Transport
    env: dict[str, str] = field(default_factory=dict)
    #: The transport is an append-only log (Kafka): it hands envelopes out in
    #: the order they were written (an expired turn cannot jump the queue) and
    #: shares no transaction with the store. The contract suite asks this, not
    #: the backend's name.
    log: bool = False
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def dispatcher(self, **kw: Any) -> Dispatcher:
        return Dispatcher(self.store, self.transport, self.settings, **kw)

    @property
    def pg_schema(self) -> str:
        """The schema a PostgreSQL harness works in (its URI's search_path)."""
        return self.env["STATE_DB_URI"].rsplit("search_path%3D", 1)[1]

    def worker(self, registry: Registry, threads: int = 2, **kw: Any) -> Worker:
        opts = WorkerOptions(threads=threads, get_wait_s=0.05, heartbeat_s=1.0, **kw)
        return Worker(self.settings, self.store, self.transport, registry, options=opts)

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            fn()
        self.transport.close()
        self.store.close()


def _settings(env: dict[str, str], overrides: dict[str, Any]) -> Settings:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_settings(**overrides)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def descriptors_of(path: Path) -> int:
    """How many file descriptors of this process are open on ``path`` (Linux)."""
    target = os.path.realpath(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                n += 1
        except OSError:  # closed since it was listed (the listing's own descriptor)
            continue
    return n


def sqlite_harness(tmp_path: Path, **overrides: Any) -> Harness:
    env = {"AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"), "TASK_QUEUE_BACKEND": "sqlite"}
    settings = _settings(env, overrides)
    store, transport = open_backends(settings)
    return Harness("sqlite", settings, store, transport, env=env)


def memory_harness(tmp_path: Path, **overrides: Any) -> Harness:
    """Store and transport in process memory (agentdispatch.testing), on the wall clock."""
    from agentdispatch.testing import MemoryBackend

    env = {"AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data")}
    backend = MemoryBackend(settings=_settings(env, overrides))
    return Harness("memory", backend.settings, backend.store, backend.transport, env=env)


def postgres_harness(tmp_path: Path, **overrides: Any) -> Harness:
    """Store and transport on a fresh schema of the test PostgreSQL (dropped at close)."""
    from pg import create_schema

    _name, uri, drop = create_schema()
    return _pg_backed("postgres", uri, drop, overrides)


def pg_harness_at(uri: str, drop: Callable[[], None], **overrides: Any) -> Harness:
    """Store and transport on the PostgreSQL database at ``uri`` (a private
    cluster, say); ``drop`` runs after the pools are closed."""
    return _pg_backed("postgres", uri, drop, overrides)


def _pg_backed(name: str, uri: str, drop: Callable[[], None], overrides: dict[str, Any], **extra_env: str) -> Harness:
    """The PostgreSQL store and transport at ``uri``; ``drop`` removes what
    holds them, after the pools are closed (or when opening fails)."""
    env = {"STATE_DB_URI": uri, "TASK_QUEUE_BACKEND": "postgres", **extra_env}
    try:
        settings = _settings(env, overrides)
        store, transport = open_backends(settings, migrate=True)
    except BaseException:
        drop()
        raise
    h = Harness(name, settings, store, transport, env=env)

    def close_then_drop() -> None:
        # Harness.close runs cleanup before closing the pools: close them first.
        transport.close()
        store.close()
        drop()

    h.cleanup.append(close_then_drop)
    return h


def kafka_harness(tmp_path: Path, *, pg: bool = False, **overrides: Any) -> Harness:
    """Envelopes on a fresh Tansu broker (started here, killed at close); the
    store on SQLite, or on a fresh PostgreSQL database with ``pg``."""
    from agentdispatch.backends.kafka.transport import KafkaTransport
    from agentdispatch.factory import open_store
    from kafka_broker import Broker

    broker = Broker(tmp_path / "broker").start()
    env = {
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"),
        "TASK_QUEUE_BACKEND": "kafka",
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
    }
    cleanup: list[Callable[[], None]] = [broker.kill]
    if pg:
        env["STATE_DB_URI"] = fresh_pg_database(cleanup)
    try:
        settings = _settings(env, overrides)
        store = open_store(settings, migrate=True)
        # Short group timeouts: Tansu waits for the rebalance timeout on joins.
        transport = KafkaTransport(settings, max_poll_interval_ms=10_000, session_timeout_ms=6_000)
    except BaseException:
        for fn in reversed(cleanup):
            fn()
        raise
    h = Harness("kafka-pg" if pg else "kafka", settings, store, transport, env=env, log=True)
    # Close the clients while the broker still answers, then kill it.
    h.cleanup.extend([*cleanup, transport.close])
    return h


# Emptied databases of this test process, ready for the next test: dropping a
# database forces a checkpoint (seconds on a slow disk), emptying it does not.
_SPARE_DATABASES: list[str] = []
_DROP_AT_EXIT: list[str] = []


def _pg_base() -> str:
    from pg import BASE_URI

    return BASE_URI


def fresh_pg_database(cleanup: list[Callable[[], None]]) -> str:
    """An empty database on the test server (a new one, or one an earlier test
    of this process left and that was emptied); emptied again at cleanup."""
    import psycopg

    base = _pg_base()
    if _SPARE_DATABASES:
        name = _SPARE_DATABASES.pop()
    else:
        name = f"ad_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        if not _DROP_AT_EXIT:
            atexit.register(_drop_spares)
        _DROP_AT_EXIT.append(name)
    uri = base.rsplit("/", 1)[0] + "/" + name

    def empty() -> None:
        with psycopg.connect(base, autocommit=True) as conn:
            # Killed workers' and PgBouncer's server connections may hold locks.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        with psycopg.connect(uri, autocommit=True) as conn:
            own = "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
            schemas = [r[0] for r in conn.execute(own)]
            for schema in schemas:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
            conn.execute("CREATE SCHEMA public")
        _SPARE_DATABASES.append(name)

    cleanup.insert(0, empty)  # runs after the broker is gone and the store closed
    return uri


def _drop_spares() -> None:
    import psycopg

    with psycopg.connect(_pg_base(), autocommit=True) as conn:
        for name in _DROP_AT_EXIT:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def bouncer_harness(tmp_path: Path, **overrides: Any) -> Harness:
    """Store and transport on a fresh database reached through PgBouncer in
    transaction mode: nothing on the correctness path may rely on session
    state (LISTEN notifications are lost there: the polling fallback works)."""
    from pgbouncer import bouncer

    base = _pg_base()
    cleanup: list[Callable[[], None]] = []
    direct = fresh_pg_database(cleanup)

    def drop() -> None:
        for fn in cleanup:
            fn()

    # Configured as docs/operations.md says to run behind PgBouncer. The switch-off
    # after a lost prepared statement is tested in test_postgres_pgbouncer.py:
    # here it would abandon a worker's turn to its lease TTL, once per process.
    uri = bouncer(base).uri(direct.rsplit("/", 1)[1])
    return _pg_backed("pgbouncer", uri, drop, overrides, AGENT_DISPATCH_PG_PREPARED_STATEMENTS="0")


BUILDERS: dict[str, Callable[..., Harness]] = {
    "sqlite": sqlite_harness,
    "memory": memory_harness,
    "postgres": postgres_harness,
    "pgbouncer": bouncer_harness,
    "kafka": kafka_harness,
    "kafka-pg": lambda tmp_path, **kw: kafka_harness(tmp_path, pg=True, **kw),
}

_wanted = os.environ.get("AGENTDISPATCH_TEST_BACKENDS")
CONTRACT_BACKENDS = [b.strip() for b in _wanted.split(",")] if _wanted else list(BUILDERS)
