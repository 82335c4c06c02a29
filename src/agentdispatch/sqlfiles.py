"""Named SQL queries kept in ``.sql`` files (``-- name: foo`` blocks)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def queries(package: str, filename: str) -> dict[str, str]:
    """Parse ``filename`` in ``package`` into ``{name: sql}``."""
    text = resources.files(package).joinpath(filename).read_text()
    parts = _NAME.split(text)
    return {parts[i]: compact(parts[i + 1]) for i in range(1, len(parts), 2)}


def compact(sql: str) -> str:
    """The statement as sent: without its comment lines and indentation (the
    comments are for readers of the file). A shorter text is also cheaper for
    the driver, which caches the conversion of statements up to 4 KiB only and
    otherwise parses the statement again on every execution. Our SQL files
    hold no string literal spanning lines, so this changes no value."""
    lines = (line.strip() for line in sql.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("--"))


class Queries:
    """Named queries of one ``.sql`` file, read on first use (no I/O at import)."""

    def __init__(self, package: str, filename: str) -> None:
        self.package = package
        self.filename = filename

    def __getitem__(self, name: str) -> str:
        return queries(self.package, self.filename)[name]
