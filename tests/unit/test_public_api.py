"""The public surface is explicit: ``agentdispatch.__all__`` is pinned here.

Changing it is an API change: update this list deliberately, with a CHANGELOG entry.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import agentdispatch

PINNED = [
    "AgentDispatchError",
    "AsyncClient",
    "AsyncWorker",
    "Client",
    "ConfigError",
    "DepthUnavailable",
    "Dispatcher",
    "EffectInFlight",
    "EffectUnknown",
    "Envelope",
    "Fence",
    "IdempotencyConflict",
    "InvalidEnvelope",
    "InvalidInput",
    "InvalidTransition",
    "JobHandle",
    "JobNotFound",
    "LeaseGuard",
    "LeaseLost",
    "NOT_HAPPENED",
    "NonRetryableError",
    "Outcome",
    "OutcomeConflict",
    "Overloaded",
    "PayloadTooLarge",
    "QueueFull",
    "Registry",
    "RuntimeOptions",
    "Settings",
    "Status",
    "Submission",
    "TaskQueueUnavailable",
    "Turn",
    "WorkItem",
    "Worker",
    "WorkerOptions",
    "__version__",
    "load_settings",
    "new_job_id",
    "open_backends",
]


def test_all_is_pinned() -> None:
    assert sorted(agentdispatch.__all__) == sorted(PINNED)
    assert len(set(agentdispatch.__all__)) == len(agentdispatch.__all__)


def test_every_public_name_exists_and_has_a_docstring() -> None:
    for name in agentdispatch.__all__:
        obj = getattr(agentdispatch, name)
        if name == "__version__":
            assert isinstance(obj, str) and obj
            continue
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_errors_derive_from_the_base() -> None:
    for name in agentdispatch.__all__:
        obj = getattr(agentdispatch, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, agentdispatch.AgentDispatchError), name


def test_import_does_no_io_and_reads_no_settings(tmp_path: Path) -> None:
    # A fresh interpreter with a HOME it cannot write to: importing must not create files.
    code = "import agentdispatch, agentdispatch.cli; print(len(agentdispatch.__all__))"
    env = {"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(len(PINNED))
    assert list(tmp_path.iterdir()) == []


def test_the_testing_module_is_public_and_pinned() -> None:
    # Users test their handlers with it: its surface is an API like the package's.
    import agentdispatch.testing as testing

    assert testing.__all__ == ["FakeClock", "MemoryBackend", "memory_dispatcher"]
    for name in testing.__all__:
        obj = getattr(testing, name)
        assert inspect.getdoc(obj), f"testing.{name} has no docstring"
        for member, value in vars(obj).items():
            if not member.startswith("_") and callable(value):
                assert inspect.getdoc(value), f"testing.{name}.{member} has no docstring"
