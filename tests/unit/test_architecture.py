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
        if isinstance(node, ast.ImportFrom):
            # ``from .x import y`` may import the module ``x.y`` as well.
            module = "." * node.level + (node.module or "")
            found.add(module)
            found.update(f"{module.rstrip('.')}.{a.name}" if node.module else module + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_only_settings_reads_the_environment() -> None:
    readers = [p.relative_to(SRC) for p in _modules() if "os.environ" in p.read_text() or "getenv" in p.read_text()]
    assert readers == [Path("settings.py")]


#: The seams every backend implements; they belong to no database.
SEAM_MODULES = {
    "stores.base",
    "stores.engine",
    "stores.ledger",
    "stores.rows",
    "stores.schema",
    "transports.base",
    "transports.flow",
}


def _absolute(path: Path, name: str) -> str:
    """The dotted module an import names, relative ones resolved."""
    if not name.startswith("."):
        return name.removeprefix("agentdispatch.")
    level = len(name) - len(name.lstrip("."))
    package = list(path.relative_to(SRC).parent.parts)
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, name.lstrip(".")]).strip(".")


def _backend_modules() -> dict[str, str]:
    """Every backend module (dotted, under the package) and its database: the
    directory under ``backends/`` it lives in, so a new file is covered
    without editing this test."""
    found: dict[str, str] = {}
    for path in SRC.glob("backends/*/*.py"):
        dotted = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if path.stem != "__init__":
            found[dotted] = path.parent.name
    return found


def test_every_backend_lives_in_its_database_package() -> None:
    found = _backend_modules()
    assert set(found.values()) == {"sqlite", "postgres", "kafka", "memory"}
    # Outside backends/ only the seams remain: no connection layer or store
    # of one database sits beside them.
    seams = {
        ".".join(p.relative_to(SRC).with_suffix("").parts)
        for p in [*SRC.glob("stores/*.py"), *SRC.glob("transports/*.py"), *SRC.glob("*_db.py")]
        if p.stem != "__init__"
    }
    assert seams == SEAM_MODULES


def test_no_backend_imports_another() -> None:
    """A backend module imports no module of another database."""
    modules = _backend_modules()
    for module, database in modules.items():
        path = SRC / (module.replace(".", "/") + ".py")
        for target in {_absolute(path, n) for n in _imports(path)} & set(modules):
            assert modules[target] == database, f"{module} ({database}) imports {target} ({modules[target]})"


#: Modules outside the backends that may import one: the factory (every
#: backend) and ``agentdispatch.testing`` (the in-memory one).
BACKEND_IMPORTERS = {"factory", "testing"}
#: Known reaches past the seams into one backend: none.
KNOWN_REACHES: set[tuple[str, str]] = set()


def test_only_the_factory_imports_backends() -> None:
    """Seam modules and callers import no backend module: they hold a store
    and a transport through the protocols of ``stores.base`` and
    ``transports.base``."""
    modules = _backend_modules()
    reaches: set[tuple[str, str]] = set()
    for path in _modules():
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if module in modules or module in BACKEND_IMPORTERS:
            continue
        for target in {_absolute(path, n) for n in _imports(path)} & set(modules):
            reaches.add((module, target))
    assert reaches == KNOWN_REACHES


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
        "import agentdispatch.backends.sqlite.store, agentdispatch.backends.sqlite.transport\n"
        "import agentdispatch.backends.postgres.store, agentdispatch.backends.postgres.transport\n"
        "import agentdispatch.backends.kafka.transport\n"
        "from agentdispatch.sqlfiles import queries\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "print(queries.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0", "a module read its SQL at import"
