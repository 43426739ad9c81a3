"""Which file system a directory is on, and whether it is a network one, from the kernel's
mount table (/proc/self/mountinfo).

Apart from the spec directory's watcher, which asks it once at its start: inotify reports
only what this node's kernel did, so on NFS, Lustre or GPFS a spec written from a login
node or another compute node makes no event here, and only the relist sees it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
NETWORK_FILESYSTEMS = frozenset(
    {
        "9p", "afs", "beegfs", "ceph", "cifs", "dvs", "fuse.glusterfs", "fuse.sshfs",
        "gpfs", "glusterfs", "lustre", "ncpfs", "nfs", "nfs4", "orangefs", "panfs",
        "pvfs2", "smb3", "smbfs", "wekafs",
    }
)  # fmt: skip
"""File systems shared between nodes. `dvs` is Cray's Data Virtualization Service, which
projects GPFS (Perlmutter's home and community file systems) onto the compute nodes;
Perlmutter's $SCRATCH is `lustre`."""
_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A mount point as mountinfo writes it: space, tab, newline and backslash as \\ooo."""
    return _ESCAPE.sub(lambda match: chr(int(match[1], 8)), field)


def filesystem_of(path: str, mountinfo: str) -> str | None:
    """The type of the file system `path` (absolute, links resolved) is on, from the text of
    a mountinfo file: the mount whose point is the longest prefix of `path`, the last listed
    where several share a point (a later mount hides an earlier one). None if none is."""
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        fstype = line.partition(" - ")[2].split(" ")[0]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return None if best is None else best[1]


def network_filesystem(directory: Path, mountinfo: Path = MOUNTINFO) -> str | None:
    """The network file system `directory` is on (`lustre`, `nfs4`, ...), None where it is
    on a local one or the mount table cannot be read (not Linux)."""
    try:
        text = mountinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fstype = filesystem_of(os.path.realpath(directory), text)
    if fstype is None:
        return None
    return fstype if fstype in NETWORK_FILESYSTEMS or fstype.startswith("nfs") else None
