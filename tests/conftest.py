"""Shared fixtures: one harness per backend under test."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from backends import BUILDERS, CONTRACT_BACKENDS, Harness, fresh_pg_database, pg_harness_at


def pytest_configure(config: pytest.Config) -> None:
    """The suite starts hundreds of CLI, gateway and worker subprocesses: give
    them a shared bytecode cache (under pytest's cache directory, outside the
    source tree) so each does not compile every module it imports from source
    again when the environment turns bytecode writing off."""
    # Without the cache plugin (``-p no:cacheprovider``) there is no cache.
    cache = getattr(config, "cache", None)
    if cache is None or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    os.environ["PYTHONPYCACHEPREFIX"] = str(cache.mkdir("pycache"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Crash tests run one after another on one pytest-xdist worker (with
    ``--dist loadgroup``): each runs a fleet of processes, and two side by side
    on two cores would starve their leases of renewals. The Kafka crash tests
    are a second such queue beside the first: their fleets spend most of
    their time waiting for the broker's consumer group (a session timeout
    after each SIGKILL, a rejoin after a broker restart), not on the CPU, and
    one queue of both kinds made the longest path of the whole run. Soak runs (minutes
    each, for the figures in the notes) are left out unless
    ``AGENTDISPATCH_SOAK=1``: deselected, never skipped."""
    if not os.environ.get("AGENTDISPATCH_SOAK"):
        soak = [item for item in items if item.get_closest_marker("soak")]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [item for item in items if not item.get_closest_marker("soak")]
    for item in items:
        if item.get_closest_marker("slow"):
            kafka = item.nodeid.split("::")[0].endswith("_kafka_crash.py")
            item.add_marker(pytest.mark.xdist_group("crash-kafka" if kafka else "crash"))
    # Longest first, so the run does not end waiting on one long test that
    # was handed out last: the crash group, then the directories whose tests
    # start real processes, then the in-process contract and unit tests.
    items.sort(key=_start_order)


#: Test directories whose tests start gateway, worker and CLI processes.
_PROCESS_DIRS = frozenset({"e2e", "intake", "integration"})


def _start_order(item: pytest.Item) -> int:
    if item.get_closest_marker("slow"):
        return 0
    folders = item.nodeid.split("::")[0].split("/")[:-1]
    return 1 if _PROCESS_DIRS.intersection(folders) else 2


@pytest.fixture(params=CONTRACT_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    """Each backend of the contract matrix."""
    return str(request.param)


@pytest.fixture
def make_harness(backend_name: str, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    """Build harnesses of the current backend with settings overrides."""
    made: list[Harness] = []

    def build(**overrides: Any) -> Harness:
        h = BUILDERS[backend_name](tmp_path / f"h{len(made)}", **overrides)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


@pytest.fixture
def harness(make_harness: Callable[..., Harness]) -> Harness:
    """A fresh store + transport of each backend in the contract matrix."""
    return make_harness()


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Harness]:
    """PostgreSQL store and transport on a fresh schema (for PostgreSQL-only tests)."""
    h = BUILDERS["postgres"](tmp_path)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def pg_own_db() -> Iterator[Harness]:
    """PostgreSQL store and transport on a database of their own, for what is
    database-wide: NOTIFY reaches every listener of a database, and the vacuum
    horizon and pg_stat_activity are the whole database's."""
    cleanup: list[Callable[[], None]] = []
    h = pg_harness_at(fresh_pg_database(cleanup), lambda: [fn() for fn in cleanup])
    try:
        yield h
    finally:
        h.close()
