"""The schema of each SQL dialect: one base schema plus numbered migrations.

``sql/<dialect>/schema.sql`` is the whole schema as of the version its first
line names (``-- schema version: 13``). A later release changes the schema
with a migration ``NNN_name.sql`` beside it, ``NNN`` above that version. A
store's ``migrate`` applies, in one transaction, what the database lacks: on a
fresh database the base schema and then every migration, else the migrations
above its recorded version. Each applied step is a row of
``dispatch_migrations``, so the database says which steps built it.

Folding a migration into the base is for migrations no release has shipped
(a database at the older version would need the file): write its effect into
the CREATE statements of ``schema.sql`` (no ALTER, no data step; a function
appears once, in its final form), set the first line to its number and
delete the file. ``python tests/schema_dump.py sqlite|postgres`` prints the
catalog of a fresh database: the outputs before and after a fold must match.
The schema tests compare a fresh database with one upgraded step by step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from ..errors import TaskQueueUnavailable

BASE_FILE = "schema.sql"
#: The runner's own table, created before the version is known (valid DDL in
#: both dialects).
CREATE_VERSIONS = (
    "CREATE TABLE IF NOT EXISTS dispatch_migrations ("
    "version integer PRIMARY KEY, name text NOT NULL, applied_at double precision NOT NULL)"
)
_VERSION_LINE = re.compile(r"^-- schema version: (\d+)$")
_MIGRATION = re.compile(r"^(\d{3})_\w+\.sql$")


@dataclass(frozen=True)
class Step:
    """One unit of the schema: the base (``schema.sql``) or one migration."""

    version: int
    name: str
    sql: str


@cache
def steps(package: str) -> tuple[Step, ...]:
    """The base schema of ``package``, then its migrations in order."""
    files = resources.files(package)
    base_sql = files.joinpath(BASE_FILE).read_text()
    first = _VERSION_LINE.match(base_sql.split("\n", 1)[0])
    if first is None:
        raise ValueError(f"{package}/{BASE_FILE} must start with '-- schema version: N'")
    base = Step(int(first.group(1)), BASE_FILE, base_sql)
    later: list[Step] = []
    for entry in files.iterdir():
        m = _MIGRATION.match(entry.name)
        if m:
            later.append(Step(int(m.group(1)), entry.name, entry.read_text()))
    later.sort(key=lambda s: s.version)
    versions = [s.version for s in later]
    if len(set(versions)) != len(versions) or any(v <= base.version for v in versions):
        raise ValueError(f"{package}: migrations {versions} must be unique and above the base {base.version}")
    return (base, *later)


def latest(package: str) -> int:
    """The version a fully migrated database of ``package`` records."""
    return steps(package)[-1].version


def pending(package: str, applied: int, *, has_schema: bool) -> list[Step]:
    """The steps to apply to a database at version ``applied`` (0: none
    recorded); ``has_schema`` says whether it holds agentdispatch tables."""
    base, *later = steps(package)
    if applied == 0 and not has_schema:
        return [base, *later]
    if applied < base.version:
        # Only a development build before 0.1.0 made such a database: its
        # migrations were folded into the base and are gone.
        raise TaskQueueUnavailable(
            f"the database holds a development schema (version {applied}) that this release cannot "
            f"upgrade to its base {base.version}; recreate the database, then run `agentdispatch migrate`"
        )
    return [s for s in later if s.version > applied]
