"""The schema runner, on SQLite and the real PostgreSQL: a fresh database and
one upgraded step by step (base schema, rows, then each later migration) end
with the same catalog; start-up refuses a schema older than the release."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.stores import schema
from agentdispatch.stores.base import NewJob, Store
from pg import admin, create_schema
from schema_dump import pg_dump, sqlite_dump

#: A later release's migration, per dialect: a column, an index and (the kind
#: of step a fold must turn into CREATE statements) a backfill of old rows.
LATER = {
    "sqlite": "ALTER TABLE work_items ADD COLUMN note TEXT NOT NULL DEFAULT '';\n"
    "UPDATE work_items SET note = kind;\n"
    "CREATE INDEX work_items_note ON work_items (note);\n",
    "postgres": "ALTER TABLE work_items ADD COLUMN note text NOT NULL DEFAULT '';\n"
    "UPDATE work_items SET note = kind;\n"
    "CREATE INDEX work_items_note ON work_items (note);\n",
}


@dataclass
class Database:
    """One empty database of a dialect: a store on it and its catalog dump."""

    dialect: str
    package: str
    open: Callable[[], Store]
    dump: Callable[[], list[str]]
    raw: Callable[[str], None]


Factory = Callable[[], Database]


@pytest.fixture(params=["sqlite", "postgres"])
def databases(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Makes empty databases of one dialect (dropped after the test)."""
    drops: list[Callable[[], None]] = []

    def sqlite_db() -> Database:
        path = tmp_path / f"db{len(drops)}.sqlite"
        drops.append(lambda: None)

        def raw(sql: str) -> None:
            with sqlite3.connect(path) as conn:
                conn.executescript(sql)

        return Database(
            "sqlite", "agentdispatch.backends.sqlite.sql", lambda: SqliteStore(path), lambda: sqlite_dump(path), raw
        )

    def postgres_db() -> Database:
        name, uri, drop = create_schema()
        drops.append(drop)

        def raw(sql: str) -> None:
            with admin() as conn:
                conn.execute(f"SET search_path = {name}")
                conn.execute(sql.encode())

        return Database(
            "postgres", "agentdispatch.backends.postgres.sql", lambda: PostgresStore(uri), lambda: pg_dump(name), raw
        )

    try:
        yield sqlite_db if request.param == "sqlite" else postgres_db
    finally:
        for drop in drops:
            drop()


def _only(monkeypatch: pytest.MonkeyPatch, steps: tuple[schema.Step, ...]) -> None:
    """Make the runner see ``steps`` as the release's schema."""
    monkeypatch.setattr(schema, "steps", lambda package: steps)


def _migrate(db: Database) -> int:
    store = db.open()
    try:
        store.migrate()
        return store.schema_version()
    finally:
        store.close()


def _submit(db: Database, job_id: str) -> None:
    store = db.open()
    try:
        job = NewJob(job_id=job_id, tenant="acme", session_id=job_id, kind="echo", payload=None, max_attempts=3)
        store.submit([job], max_depth=100)
    finally:
        store.close()


def _upgraded(db: Database, monkeypatch: pytest.MonkeyPatch, steps: tuple[schema.Step, ...]) -> list[int]:
    """Build ``db`` as the field does: the base, rows, then one release's
    migration at a time. Returns the version after each release."""
    versions = []
    for n in range(1, len(steps) + 1):
        _only(monkeypatch, steps[:n])
        versions.append(_migrate(db))
        _submit(db, f"job-{n}")
    return versions


def test_a_fresh_database_and_an_upgraded_one_have_the_same_schema(
    databases: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh, upgraded = databases(), databases()
    steps = schema.steps(fresh.package)
    assert _migrate(fresh) == schema.latest(fresh.package)
    assert _upgraded(upgraded, monkeypatch, steps) == [s.version for s in steps]
    assert upgraded.dump() == fresh.dump()


def test_a_later_migration_applies_on_top_of_the_base(databases: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh, upgraded = databases(), databases()
    steps = schema.steps(fresh.package)
    later = schema.Step(steps[-1].version + 1, "099_note.sql", LATER[fresh.dialect])
    _only(monkeypatch, (*steps, later))
    assert _migrate(fresh) == later.version
    versions = _upgraded(upgraded, monkeypatch, (*steps, later))
    assert versions[-2:] == [steps[-1].version, later.version]
    assert upgraded.dump() == fresh.dump()
    assert any("work_items_note" in line for line in fresh.dump())
    # Each step is recorded once; a second run applies nothing.
    store = upgraded.open()
    try:
        store.migrate()
        assert store.schema_version() == later.version
    finally:
        store.close()
    assert upgraded.dump() == fresh.dump()


def test_start_up_refuses_an_older_schema_naming_migrate(databases: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    db = databases()
    steps = schema.steps(db.package)
    store = db.open()
    try:
        with pytest.raises(TaskQueueUnavailable, match="agentdispatch migrate"):
            store.ping()
        store.migrate()
        store.ping()
        later = schema.Step(steps[-1].version + 1, "099_note.sql", LATER[db.dialect])
        _only(monkeypatch, (*steps, later))
        want = rf"version {steps[-1].version} is older than {later.version}; run `agentdispatch migrate`"
        with pytest.raises(TaskQueueUnavailable, match=want):
            store.ping()
        store.migrate()
        store.ping()
    finally:
        store.close()


def test_a_schema_older_than_the_base_is_refused_and_left_alone(databases: Factory) -> None:
    # A database a development build made before the migrations were folded:
    # tables, a version in dispatch_meta, no dispatch_migrations.
    db = databases()
    db.raw("CREATE TABLE dispatch_meta (key text PRIMARY KEY, value text NOT NULL);")
    db.raw("INSERT INTO dispatch_meta (key, value) VALUES ('schema_version', '7');")
    before = db.dump()
    store = db.open()
    try:
        with pytest.raises(TaskQueueUnavailable, match="recreate the database"):
            store.migrate()
    finally:
        store.close()
    assert db.dump() == before


def test_postgres_builds_in_its_own_schema_when_one_further_down_the_path_is_built() -> None:
    # search_path "fresh, built": the tables of "built" are visible by name,
    # yet "fresh" is where the steps create theirs, so it gets the whole schema.
    built, built_uri, drop_built = create_schema()
    fresh, _uri, drop_fresh = create_schema()
    try:
        store = PostgresStore(built_uri)
        store.migrate()
        store.close()
        both = built_uri.replace(f"search_path%3D{built}", f"search_path%3D{fresh}%2C{built}")
        assert both != built_uri
        store = PostgresStore(both)
        try:
            store.migrate()
        finally:
            store.close()
        assert pg_dump(fresh) == pg_dump(built)
    finally:
        drop_fresh()
        drop_built()
