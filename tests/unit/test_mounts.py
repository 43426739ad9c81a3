"""The spec directory's file system: on a network one the watcher sets no inotify watch
(another node's writes make no event there) and says so; it relists."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from herd_operator.runtime.mounts import filesystem_of, network_filesystem
from herd_operator.runtime.specdir import DirectoryWatcher, SpecDirectory

# Shaped as a Perlmutter compute node's (types and options as `findmnt` shows them there),
# with this test's own directories mounted over.
MOUNTINFO = """\
22 1 0:20 / / rw,relatime - overlay overlay rw
25 22 0:5 / /dev rw,nosuid - devtmpfs devtmpfs rw
41 22 0:41 / /global/homes rw,relatime shared:20 - dvs /global/u1 rw,blksize=1048576
42 22 0:42 / /pscratch rw,relatime shared:21 - lustre 10.100.0.1@kfi:/pscratch rw,flock
43 22 0:43 / /home/with\\040space rw - nfs4 server:/export rw,vers=4.2
44 42 0:44 / /pscratch/sd/u/user/local rw - tmpfs tmpfs rw
45 22 0:45 / /pscratch2 rw - xfs /dev/sdb rw
46 22 0:46 / /pscratch2 rw - lustre other@kfi:/p2 rw
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/pscratch/sd/u/user/jobs", "lustre"),
        ("/pscratch", "lustre"),
        ("/pscratchy", "overlay"),  # a prefix of the name is not a parent
        ("/pscratch/sd/u/user/local/jobs", "tmpfs"),  # a mount inside another
        ("/global/homes/u/user/jobs", "dvs"),
        ("/home/with space/jobs", "nfs4"),  # mountinfo's \040
        ("/pscratch2/jobs", "lustre"),  # the later of two mounts on one point
        ("/tmp/jobs", "overlay"),
    ],
)
def test_the_file_system_of_a_path_is_its_innermost_mount(path: str, fstype: str) -> None:
    assert filesystem_of(path, MOUNTINFO) == fstype


def test_only_shared_file_systems_count_as_network_ones(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(f"50 22 0:50 / {tmp_path} rw - lustre fs@kfi:/x rw\n")
    assert network_filesystem(tmp_path / "jobs", table) == "lustre"
    table.write_text(f"50 22 0:50 / {tmp_path} rw - ext4 /dev/sda1 rw\n")
    assert network_filesystem(tmp_path / "jobs", table) is None
    assert network_filesystem(tmp_path, tmp_path / "no-such-table") is None


@pytest.mark.parametrize(("fstype", "events"), [("lustre", False), ("nfs", False), ("ext4", True)])
def test_a_spec_dir_on_a_network_file_system_is_relisted_without_a_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fstype: str, events: bool
) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(f"50 22 0:50 / {tmp_path} rw - {fstype} somewhere rw\n")
    watcher = DirectoryWatcher(
        SpecDirectory(jobs), lambda _: None, relist_seconds=3600, mountinfo=table
    )
    caplog.set_level(logging.INFO, logger="herd_operator.runtime.specdir")
    watcher.start()
    try:
        assert (watcher._observer is not None) is events
        said = [r.getMessage() for r in caplog.records if "relisting every" in r.getMessage()]
        expected = (
            f"{jobs} is on {fstype}, where a file written on another node makes no event "
            "here: relisting every 3600s instead (--relist-seconds)"
        )
        assert said == ([] if events else [expected])
    finally:
        watcher.stop()
