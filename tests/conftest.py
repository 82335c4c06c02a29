"""Shared fixtures: one harness per backend under test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from backends import BUILDERS, CONTRACT_BACKENDS, Harness


@pytest.fixture(params=CONTRACT_BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """A fresh store + transport of each backend in the contract matrix."""
    h = BUILDERS[request.param](tmp_path)
    try:
        yield h
    finally:
        h.close()
