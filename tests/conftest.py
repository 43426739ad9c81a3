"""The order in which pytest-xdist hands out the test files: the longest first.

With `--dist loadfile` each file is one unit of work and a worker runs it whole. xdist's
default (`--loadscope-reorder`) hands out the files with the most tests first, which here
means the unit files (hundreds of short tests each) first and the few-test integration
files that run for minutes last: in CI the 4-test test_torchrun.py and the 3-test
test_slurm.py started near the end and ran on while the other workers had nothing left.
pyproject's addopts turn that off (`--no-loadscope-reorder`), so xdist keeps the order this
hook leaves: the files below first, longest first (the longest-processing-time rule), then
every other file in pytest's usual order (the rest of tests/integration, then the top-level
tests, then tests/unit, whose many short files fill in the tail).

The list is a guess from CI's `--durations` (the sum of each file's tests among the 25
slowest of four fresh-clone runs, 2026-12-02) and one whole run here; a wrong or stale entry
costs time, never a test. Nothing is skipped or deselected: the hook only sorts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

HERE = Path(__file__).parent

# No wall-clock deadline for any hypothesis example: on a shared machine an example that
# takes 0.01 ms took 258 ms once (CI, test_efficiency), and hypothesis failed the test as
# flaky. 45 tests already said `deadline=None` each; a test that wants one still can.
settings.register_profile("herd", deadline=None)
settings.load_profile("herd")

LONGEST_FIRST = (
    "integration/test_torchrun.py",  # 211-274 s, one module fixture that all its tests share
    "integration/test_slurm.py",  # 264-350 s
    "integration/test_policies.py",  # 180-367 s
    "integration/test_faults.py",  # 164-241 s
    "integration/test_batch_policy.py",  # 193-245 s
    "integration/test_multinode.py",  # 43-187 s
    "integration/test_crash_only.py",  # 116-194 s
    "integration/test_driver.py",  # 93-181 s
    "integration/test_verbs.py",  # 54-142 s
    "integration/test_limits.py",  # 53-151 s
    "test_quality.py",  # 55-93 s (mypy)
    "integration/test_jobs.py",  # 45-89 s
    "integration/test_queue.py",  # 77-80 s
    "integration/test_report.py",  # 78 s
    "test_bench.py",  # 54-59 s (its fixture's quick benchmark run)
    # Not among CI's 25 slowest; the longest of the rest in one whole run here (load 12-43):
    "unit/test_arbitration.py",  # 215 s there (80 tests, hypothesis)
    "integration/test_run_command.py",  # 155 s there
    "test_packaging.py",  # 146 s there (builds and installs the package)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def place(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(HERE).as_posix()
        except ValueError:  # a test outside tests/ (named on the command line)
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=place)  # stable: each file's own order and the others' order are kept
