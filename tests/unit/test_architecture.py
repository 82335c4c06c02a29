"""Architecture rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "agentdispatch"


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add("." * node.level + node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_only_settings_reads_the_environment() -> None:
    readers = [p.relative_to(SRC) for p in _modules() if "os.environ" in p.read_text() or "getenv" in p.read_text()]
    assert readers == [Path("settings.py")]


BACKENDS = ["stores.sqlite", "stores.postgres", "transports.sqlite", "transports.postgres", "transports.kafka"]


def _absolute(path: Path, name: str) -> str:
    """The dotted module an import names, relative ones resolved."""
    if not name.startswith("."):
        return name.removeprefix("agentdispatch.")
    level = len(name) - len(name.lstrip("."))
    package = list(path.relative_to(SRC).parent.parts)
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, name.lstrip(".")]).strip(".")


def test_no_backend_imports_another() -> None:
    for backend in BACKENDS:
        path = SRC / (backend.replace(".", "/") + ".py")
        targets = {_absolute(path, n) for n in _imports(path)}
        others = set(BACKENDS) - {backend}
        assert not targets & others, f"{backend} imports {targets & others}"


def test_lease_math_uses_the_database_clock() -> None:
    # The state machine takes `now`; the store logic gets it from the database.
    for rel in ("workitem.py", "stores/engine.py"):
        names = _imports(SRC / rel)
        assert "time" not in names and "datetime" not in names, rel
    engine = (SRC / "stores" / "engine.py").read_text()
    assert "now = tx.now()" in engine


def test_importing_the_package_starts_no_thread_and_reads_no_sql() -> None:
    code = (
        "import threading\n"
        "import agentdispatch, agentdispatch.cli, agentdispatch.factory\n"
        "import agentdispatch.stores.sqlite, agentdispatch.transports.sqlite\n"
        "import agentdispatch.stores.postgres, agentdispatch.transports.postgres, agentdispatch.transports.kafka\n"
        "from agentdispatch.sqlfiles import queries\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "print(queries.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0", "a module read its SQL at import"
