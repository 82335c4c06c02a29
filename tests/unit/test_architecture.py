"""Architecture rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import re
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


#: The database each backend module belongs to, by its file name. Every module
#: under stores/ and transports/ (and a top-level ``*_db.py`` connection layer)
#: is discovered, so a new backend file is covered without editing this test.
DATABASES = {"sqlite": "sqlite", "pg": "postgres", "postgres": "postgres", "kafka": "kafka", "memory": "memory"}
#: Modules of the two seams that belong to no database.
SEAM_MODULES = {"stores.base", "stores.engine", "stores.rows", "stores.schema", "transports.base"}
#: Imports from one backend into another that are known and deliberate. The
#: PostgreSQL transport shares the store's connection pool (its outbox and
#: queue rows are written in the store's transaction); issue 22 gives each
#: database one package, after which this entry goes.
KNOWN_CROSSINGS = {("transports.postgres", "stores.pg_db")}


def _absolute(path: Path, name: str) -> str:
    """The dotted module an import names, relative ones resolved."""
    if not name.startswith("."):
        return name.removeprefix("agentdispatch.")
    level = len(name) - len(name.lstrip("."))
    package = list(path.relative_to(SRC).parent.parts)
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, name.lstrip(".")]).strip(".")


def _backend_modules() -> dict[str, str]:
    """Every backend module (dotted, under the package) and its database."""
    found: dict[str, str] = {}
    candidates = [*SRC.glob("stores/*.py"), *SRC.glob("transports/*.py"), *SRC.glob("*_db.py")]
    for path in candidates:
        dotted = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if path.stem == "__init__" or dotted in SEAM_MODULES:
            continue
        database = DATABASES.get(re.split(r"[_.]", path.stem)[0])
        assert database is not None, f"{dotted}: neither a seam module nor named after a database"
        found[dotted] = database
    return found


def test_every_backend_module_is_discovered() -> None:
    found = _backend_modules()
    # The modules the first version of this test listed by hand, and the
    # connection layers that list missed.
    assert {
        "stores.sqlite",
        "stores.postgres",
        "transports.kafka",
        "stores.pg_db",
        "stores.pg_tx",
        "sqlite_db",
        "memory_db",
        "stores.memory_tx",
    } <= set(found)
    assert set(found.values()) == {"sqlite", "postgres", "kafka", "memory"}


def test_no_backend_imports_another() -> None:
    """A backend module imports no module of another database, and the store
    and transport backends reach each other only through the known crossings;
    a module may import the shared connection layer of its own database."""
    modules = _backend_modules()
    crossings: set[tuple[str, str]] = set()
    for module, database in modules.items():
        path = SRC / (module.replace(".", "/") + ".py")
        for target in {_absolute(path, n) for n in _imports(path)} & set(modules):
            assert modules[target] == database, f"{module} ({database}) imports {target} ({modules[target]})"
            side, target_side = module.split(".")[0], target.split(".")[0]
            if target_side in ("stores", "transports") and side != target_side:
                crossings.add((module, target))
    assert crossings == KNOWN_CROSSINGS


#: Modules outside the backends that may import one: the factory (every
#: backend) and ``agentdispatch.testing`` (the in-memory one).
BACKEND_IMPORTERS = {"factory", "testing"}
#: Known reaches past the seams into one backend: intake's PostgreSQL request
#: path, until intake has a seam of its own (issue 22).
KNOWN_REACHES = {("gateway.intake.admit", "stores.pg_tx")}


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
        "import agentdispatch.stores.sqlite, agentdispatch.transports.sqlite\n"
        "import agentdispatch.stores.postgres, agentdispatch.transports.postgres, agentdispatch.transports.kafka\n"
        "from agentdispatch.sqlfiles import queries\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "print(queries.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0", "a module read its SQL at import"
