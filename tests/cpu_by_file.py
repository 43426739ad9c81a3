"""The CPU each test file costs, every process it starts included: a pytest plugin and its
report.

`/usr/bin/time` counts only the processes their parents wait for; a job's zygote, its forked
workers and the daemons some tests start (Prometheus, Slurm's, sshd) are not, and a
test file that starts them looks cheap. A cgroup counts every process in it, whoever its
parent. With this plugin each pytest process (each xdist worker, or the only one under
`-n 0`) moves itself into a cgroup of its own for each test file, before the file's first
test: what the file's tests start is born there and stays there, so each file's cgroup
holds what it cost, lingering processes included (a zygote left by its driver, a daemon).
What the pytest processes spend before their first file (collection) stays where the run
was started. Not for CI: an opt-in measure (docs/benchmarks.md says how it was used).

    mkdir /sys/fs/cgroup/cpuacct/run && echo $$ > /sys/fs/cgroup/cpuacct/run/cgroup.procs
    HERD_TEST_CPU_CGROUP=/sys/fs/cgroup/cpuacct/run pytest -p tests.cpu_by_file ...
    python -m tests.cpu_by_file /sys/fs/cgroup/cpuacct/run    # the table, heaviest first

Either hierarchy: cgroup v1's cpuacct (`cpuacct.usage_user`, `cpuacct.usage_sys`, in ns)
or a cgroup v2 directory (`cpu.stat`'s `user_usec`, `system_usec`). Moving a process needs
write access to the cgroup's `cgroup.procs` (root, or a delegated subtree such as
`systemd-run --user --scope`'s).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT_ENV = "HERD_TEST_CPU_CGROUP"
"""The cgroup directory the run was started in; the files' cgroups are made inside it."""

_moved_to: list[Path] = []
"""The cgroup this process is in now (none yet: still where the run started)."""


def cgroup_name(nodeid: str) -> str:
    """A test's file as one cgroup directory name: `integration/test_x.py` ->
    `integration.test_x.py` (cgroup names cannot hold `/`)."""
    path = nodeid.split("::", 1)[0]
    path = path.removeprefix("tests/")
    return re.sub(r"[^A-Za-z0-9_.-]", ".", path)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    root = os.environ.get(ROOT_ENV)
    if not root:
        return
    target = Path(root) / cgroup_name(item.nodeid)
    if _moved_to and _moved_to[-1] == target:
        return
    target.mkdir(exist_ok=True)
    # Writing a pid to cgroup.procs moves all of its threads (v1 and v2): the operator's
    # threads of an earlier file's fixtures come along, but those are ended by then.
    (target / "cgroup.procs").write_text(f"{os.getpid()}\n")
    _moved_to.append(target)


def cpu_seconds(cgroup: Path) -> tuple[float, float]:
    """(user, system) CPU-s of everything that ran in `cgroup` and its children."""
    if (cgroup / "cpuacct.usage_user").exists():
        user = int((cgroup / "cpuacct.usage_user").read_text()) / 1e9
        system = int((cgroup / "cpuacct.usage_sys").read_text()) / 1e9
        return user, system
    fields = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
    return int(fields["user_usec"]) / 1e6, int(fields["system_usec"]) / 1e6


def report(root: Path) -> str:
    """A Markdown table: each file's CPU-s (user + system), heaviest first, then the rest
    of the run (collection, the pytest processes between files) and the whole."""
    rows = sorted(
        ((name.name, *cpu_seconds(name)) for name in root.iterdir() if name.is_dir()),
        key=lambda row: -(row[1] + row[2]),
    )
    whole_user, whole_system = cpu_seconds(root)
    files = sum(user + system for _, user, system in rows)
    lines = ["| File | CPU-s | user | system |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {u + s:.1f} | {u:.1f} | {s:.1f} |" for name, u, s in rows]
    lines.append(
        f"| (outside the files: collection) | {whole_user + whole_system - files:.1f} | | |"
    )
    lines.append(
        f"| whole run | {whole_user + whole_system:.1f} | {whole_user:.1f} | {whole_system:.1f} |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
