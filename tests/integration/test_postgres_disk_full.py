"""PostgreSQL's disk fills under a real worker process: submissions are
refused with the cause (not "connection lost, outcome unknown": the server
answered, nothing was written), the worker backs off and stays up, and every
accepted turn finishes once space comes back."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from agentdispatch.errors import TaskQueueUnavailable
from backends import pg_harness_at
from diskkit import fill, small_disk, spawn_worker, stopped_cleanly, until
from pg import PrivateCluster
from ports import free_port

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="mounts a size-limited tmpfs (Linux, root)",
)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory the postgres user can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="ad-disk-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_full_disk_refuses_submissions_by_name_and_loses_no_accepted_turn(tmp_path: Path, open_dir: Path) -> None:
    with small_disk(open_dir / "disk", size="200m", mode="0755") as disk:
        cluster = PrivateCluster(parent=disk).start()
        h = pg_harness_at(cluster.uri(), cluster.destroy)
        try:
            d = h.dispatcher()
            log, port = tmp_path / "worker.log", free_port()
            with stopped_cleanly(spawn_worker(h.env, log, port, ("--concurrency", "8")), log) as worker:
                first = d.submit(Submission(kind="echo", tenant="t"))
                until(lambda: h.store.get(first.job_id, "t").status is Status.SUCCEEDED, "the worker never ran", 30)
                # Accepted, then the disk fills while it runs.
                slow = d.submit_many(
                    [Submission(kind="sleep", tenant="t", session_id=f"s{i}", payload={"seconds": 1}) for i in range(4)]
                )
                filler = fill(disk)
                # The server writes into the free room of pages and WAL segments
                # it has until it needs a new one.
                accepted, refused = [], None
                for i in range(5000):
                    late = Submission(kind="echo", tenant="t", payload="x" * 2000, idempotency_key=f"late-{i}")
                    try:
                        accepted.append(d.submit(late))
                    except TaskQueueUnavailable as exc:
                        refused = exc
                        break
                assert refused is not None, "5,000 submissions fit on a full disk"
                said = str(refused)
                assert "disk is full" in said and "unknown" not in said, said
                assert worker.poll() is None, "the worker died of a full disk"
                filler.unlink()
                # Refused before, accepted now (its caller retries with the same key).
                again = d.submit(late)
                until(
                    lambda: all(
                        h.store.get(x.job_id, "t").status is Status.SUCCEEDED for x in [*slow, *accepted, again]
                    ),
                    "accepted turns did not finish after space came back",
                    60,
                    log,
                )
        finally:
            h.close()
