"""The one place that knows every backend: builds a store and a transport
from :class:`Settings`."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import TaskQueueUnavailable
from .intake.base import IntakeStore
from .settings import Backend, Settings
from .stores.base import Store
from .transports.base import Transport
from .transports.flow import Flow, Separate


def _load(module: str, attr: str, extra: str) -> Any:
    try:
        return getattr(importlib.import_module(f"agentdispatch.{module}"), attr)
    except ImportError as exc:
        raise TaskQueueUnavailable(
            f"the {extra} backend needs `pip install 'agentdispatch[{extra}]'` ({exc.name} missing)"
        ) from None


def open_store(settings: Settings, *, migrate: bool | None = None) -> Store:
    """The WorkItem store: PostgreSQL with STATE_DB_URI, else the SQLite file.
    SQLite migrates itself (zero setup); PostgreSQL needs ``agentdispatch migrate``."""
    store: Store
    if settings.state_db_uri:
        cls = _load("backends.postgres.store", "PostgresStore", "postgres")
        # One connection first: an unreachable or missing database is one
        # line with its cause now, not pool retries and a timeout later.
        _load("backends.postgres.db", "probe", "postgres")(settings.state_db_uri)
        store = cls(
            settings.state_db_uri,
            extra_attempts=settings.max_attempts,
            prepared=settings.pg_prepared_statements,
            answer_s=settings.pg_answer_timeout_s,
        )
    else:
        from .backends.sqlite.store import SqliteStore

        store = SqliteStore(settings.sqlite_path, extra_attempts=settings.max_attempts)
        migrate = True if migrate is None else migrate
    if migrate:
        store.migrate()
    return store


def open_transport(settings: Settings, store: Store) -> Transport:
    """The transport named by TASK_QUEUE_BACKEND (auto when unset)."""
    backend = settings.backend
    if backend is Backend.SQLITE:
        if store.name != "sqlite":
            raise TaskQueueUnavailable(
                "TASK_QUEUE_BACKEND=sqlite needs the SQLite store; unset STATE_DB_URI or choose postgres"
            )
        from .backends.sqlite.store import SqliteStore
        from .backends.sqlite.transport import SqliteTransport

        # One SqliteDb per process and file: store and transport share its
        # connections and its writer mutex.
        db = store.db if isinstance(store, SqliteStore) else None
        if db is None:
            raise TaskQueueUnavailable("TASK_QUEUE_BACKEND=sqlite needs the SQLite store")
        return SqliteTransport(db)
    if backend is Backend.POSTGRES:
        if store.name != "postgres":
            raise TaskQueueUnavailable("TASK_QUEUE_BACKEND=postgres needs STATE_DB_URI=postgresql://...")
        cls = _load("backends.postgres.transport", "PostgresTransport", "postgres")
        return cls(store)  # type: ignore[no-any-return]
    cls = _load("backends.kafka.transport", "KafkaTransport", "kafka")
    return cls(settings)  # type: ignore[no-any-return]


#: Backends whose queue may live in the store's database (a module ``flow`` each).
_ONE_DATABASE = {"sqlite", "postgres", "memory"}


def open_flow(store: Store, transport: Transport) -> Flow:
    """The worker's batch verbs: each one transaction of the backend where the
    queue lives in the store's database, else store and queue composed apart
    (the store's transaction first)."""
    if store.name in _ONE_DATABASE and transport.name == store.name:
        flow: Flow | None = _load(f"backends.{store.name}.flow", "open_flow", store.name)(store, transport)
        if flow is not None:
            return flow
    return Separate(store, transport)


def open_backends(settings: Settings, *, migrate: bool | None = None) -> tuple[Store, Transport]:
    """Store and transport, ready to use."""
    store = open_store(settings, migrate=migrate)
    return store, open_transport(settings, store)


def open_intake_store(store: Store) -> IntakeStore:
    """Durable intake's tables in the WorkItem store's database (with a Kafka
    queue too: receipts live beside the WorkItems, in the store)."""
    if store.name == "sqlite":
        from .backends.sqlite.intake import SqliteIntakeStore
        from .backends.sqlite.store import SqliteStore

        if isinstance(store, SqliteStore):
            return SqliteIntakeStore(store)
    if store.name == "postgres":
        cls = _load("backends.postgres.intake", "PostgresIntakeStore", "postgres")
        return cls(store)  # type: ignore[no-any-return]
    raise ValueError(f"durable intake needs the SQLite or PostgreSQL store, not {store.name}")
