"""The base schema files read as one current schema: every object is created
once, in its final form, with no step that rewrites an earlier one."""

from __future__ import annotations

import re

import pytest

from agentdispatch.stores import schema

PACKAGES = ["agentdispatch.backends.sqlite.sql", "agentdispatch.backends.postgres.sql"]
_CREATE = re.compile(r"^CREATE (TABLE|INDEX|SEQUENCE|FUNCTION|TRIGGER) (\w+)", re.MULTILINE)


@pytest.mark.parametrize("package", PACKAGES)
def test_the_base_creates_each_object_once(package: str) -> None:
    base = schema.steps(package)[0]
    assert base.name == "schema.sql"
    names = [m.group(2) for m in _CREATE.finditer(base.sql)]
    assert {"work_items", "agent_dispatch_queue", "dispatch_schedules", "intake_receipts"} <= set(names)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # Statements that only make sense over an older schema have no place in it.
    # (Top-level statements start at column 0; function bodies are indented.)
    for rewrite in (r"^CREATE OR REPLACE", r"^CREATE \w+ IF NOT EXISTS", r"^ALTER ", r"^DROP ", r"\bRENAME TO\b"):
        assert not re.search(rewrite, base.sql, re.MULTILINE), rewrite


@pytest.mark.parametrize("package", PACKAGES)
def test_migrations_follow_the_base_in_order(package: str) -> None:
    steps = schema.steps(package)
    versions = [s.version for s in steps]
    assert versions == sorted(set(versions))
    assert schema.latest(package) == versions[-1]
