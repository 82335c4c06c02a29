"""The file system under the SQLite file. WAL keeps its index in memory that
every process sharing the file maps from a file beside it, so it works on one
host only: on a network file system two hosts' processes would each trust
their own map and could both claim a turn. Such a data dir is refused at
start (fail closed), where a local one passes."""

from __future__ import annotations

from pathlib import Path

#: Where the kernel lists this process's mounts (Linux).
MOUNTINFO = Path("/proc/self/mountinfo")

#: File system types that reach other hosts (``fuse.*`` ones by their subtype).
NETWORK = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "afs",
        "davfs",
        "fuse.sshfs",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
    }
)


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_type(path: Path, mountinfo: str) -> str | None:
    """The type of the file system ``path`` (absolute, resolved) is on, by
    the longest mount point above it in ``mountinfo``; None if none is."""
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        point = Path(_unescape(parts[4]))
        if (path == point or point in path.parents) and (best is None or len(point.parts) >= best[0]):
            best = (len(point.parts), rest.split()[0])
    return None if best is None else best[1]


def network_type(path: Path) -> str | None:
    """The network file system type ``path`` would be on, or None (a local
    one, or a system that does not list its mounts)."""
    try:
        listed = MOUNTINFO.read_text()
    except OSError:
        return None
    here = path.resolve()
    while not here.exists() and here != here.parent:
        here = here.parent  # the data dir is made on first use
    kind = mount_type(here, listed)
    return kind if kind in NETWORK else None
