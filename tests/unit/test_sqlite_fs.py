"""The SQLite rung refuses a data dir on a network file system (reliability
scenario 24: WAL's shared memory works on one host only), and takes a local
one. The mount table is the kernel's own where it can be: this machine has no
network file system, so the refusal reads a listing that names one."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentdispatch.backends.sqlite import fs
from agentdispatch.errors import TaskQueueUnavailable
from backends import sqlite_harness

LISTING = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 27 0:40 / /srv/shared rw,relatime - nfs4 server:/export rw,vers=4.2
41 40 8:2 / /srv/shared/local rw,relatime - ext4 /dev/sdb1 rw
42 27 0:42 / /mnt/with\\040space rw - cifs //server/share rw
43 27 0:43 / /home/me/remote rw - fuse.sshfs me@server: rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/srv/shared/queue/agentdispatch.db", "nfs4"),
        ("/srv/shared", "nfs4"),
        ("/srv/shared/local/queue.db", "ext4"),  # a local disk mounted inside the share
        ("/srv/sharedother/queue.db", "ext4"),  # a sibling whose name only starts alike
        ("/mnt/with space/q.db", "cifs"),
        ("/home/me/remote/q.db", "fuse.sshfs"),
        ("/var/lib/q.db", "ext4"),
    ],
)
def test_the_longest_mount_point_above_a_path_names_its_file_system(path: str, kind: str) -> None:
    assert fs.mount_type(Path(path), LISTING) == kind


def test_a_mount_over_an_earlier_one_hides_it() -> None:
    listing = LISTING + "50 27 0:50 / /srv/shared rw - ext4 /dev/sdc1 rw\n"
    assert fs.mount_type(Path("/srv/shared/q.db"), listing) == "ext4"


def test_this_machines_temp_dir_is_local(tmp_path: Path) -> None:
    assert fs.MOUNTINFO.exists()
    assert fs.mount_type(tmp_path.resolve(), fs.MOUNTINFO.read_text()) is not None
    assert fs.network_type(tmp_path / "data" / "not-made-yet" / "agentdispatch.db") is None
    sqlite_harness(tmp_path).close()  # and the store opens there


def test_a_data_dir_on_a_network_file_system_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listing = tmp_path / "mountinfo"
    listing.write_text(LISTING + f"60 27 0:60 / {tmp_path} rw - nfs4 server:/export rw\n")
    monkeypatch.setattr(fs, "MOUNTINFO", listing)
    with pytest.raises(TaskQueueUnavailable, match=r"network file system \(nfs4\).*AGENT_DISPATCH_DATA_DIR"):
        sqlite_harness(tmp_path)
    assert not list(tmp_path.rglob("*.db*"))  # refused before a file was made
