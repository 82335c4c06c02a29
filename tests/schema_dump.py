"""Catalog dumps of a built schema, for comparing two ways of building it.

``python tests/schema_dump.py sqlite|postgres`` prints the catalog of a
freshly migrated database (diff it before and after folding a migration).
Each dump is a sorted list of lines read from the database's own catalog
(``sqlite_master`` and pragmas; ``pg_catalog``), so two dumps are equal when
the databases hold the same tables, columns, constraints, indexes, triggers,
functions and sequences, however the DDL that made them was written.
"""

from __future__ import annotations

import re
import sqlite3
import sys
import tempfile
from pathlib import Path

from pg import admin


def sqlite_dump(path: Path) -> list[str]:
    """Every schema object of the SQLite file at ``path``, with its columns."""
    conn = sqlite3.connect(path)
    try:
        lines: list[str] = []
        objects = conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name"
        ).fetchall()
        for kind, name, table, sql in objects:
            lines.append(f"{kind} {name} on {table}: {_normal(str(sql))}")
            if kind == "table":
                for col in conn.execute(f"PRAGMA table_xinfo({name})"):
                    lines.append(f"column {name}.{col[1]}: {col[1:]}")
            if kind == "index":
                for col in conn.execute(f"PRAGMA index_xinfo({name})"):
                    lines.append(f"index column {name}: {col}")
        return sorted(lines)
    finally:
        conn.close()


def _normal(sql: str) -> str:
    """SQL text without layout: ``ALTER TABLE ... ADD COLUMN`` appends to the
    stored CREATE TABLE text in its own layout."""
    return re.sub(r"\s*([(),])\s*", r"\1", " ".join(sql.split()))


_PG_QUERIES = {
    "relation": """
        SELECT c.relkind::text || ' ' || c.relname FROM pg_class c WHERE c.relnamespace = %(ns)s::regnamespace""",
    "column": """
        SELECT c.relname || '.' || a.attname || ' #' || row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum)
               || ' ' || format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull
               || ' generated=' || a.attgenerated::text || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = %(ns)s::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraint": """
        SELECT r.relname || ' ' || n.conname || ' ' || pg_get_constraintdef(n.oid)
        FROM pg_constraint n JOIN pg_class r ON r.oid = n.conrelid
        WHERE n.connamespace = %(ns)s::regnamespace""",
    "index": """
        SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace = %(ns)s::regnamespace""",
    "function": """
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') -> '
               || pg_get_function_result(p.oid) || ' ' || l.lanname || ' volatile=' || p.provolatile::text
               || ' config=' || coalesce(array_to_string(p.proconfig, ','), '') || E'\n' || p.prosrc
        FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.pronamespace = %(ns)s::regnamespace""",
    "trigger": """
        SELECT pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = %(ns)s::regnamespace AND NOT t.tgisinternal""",
    "sequence": """
        SELECT c.relname || ' ' || s.seqtypid::regtype::text || ' start=' || s.seqstart || ' inc=' || s.seqincrement
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = %(ns)s::regnamespace""",
}


def pg_dump(schema: str) -> list[str]:
    """Every object of the PostgreSQL schema ``schema`` (its name left out)."""
    lines: list[str] = []
    with admin() as conn:
        for kind, query in _PG_QUERIES.items():
            for (text,) in conn.execute(query, {"ns": schema}).fetchall():
                lines.append(f"{kind} {str(text).replace(schema + '.', '')}")
    return sorted(lines)


def main(dialect: str) -> None:
    """Print the catalog of a freshly migrated database of ``dialect``: run it
    before and after folding a migration into ``schema.sql`` and diff the two."""
    if dialect == "sqlite":
        from agentdispatch.backends.sqlite.store import SqliteStore

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "fresh.db"
            store = SqliteStore(path)
            store.migrate()
            store.close()
            lines = sqlite_dump(path)
    else:
        from agentdispatch.backends.postgres.store import PostgresStore
        from pg import create_schema

        name, uri, drop = create_schema()
        try:
            pg_store = PostgresStore(uri)
            pg_store.migrate()
            pg_store.close()
            lines = pg_dump(name)
        finally:
            drop()
    print("\n".join(line for line in lines if "dispatch_migrations" not in line))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite")
