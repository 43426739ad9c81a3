"""Bad spec files dropped live into the directory of a running operator.

One good job runs the whole time. Hypothesis writes odd and broken spec files (see
tests/fuzzing.py) one at a time, atomically, as users are told to; each must show up as
a spec problem that names its file (a warning in the log, an InvalidSpec event or a
SpecValid=False condition), and nothing may go wrong inside the operator: its thread
lives, its log holds no traceback and no ERROR, no reconcile ends in an unexpected error,
and the good job is still running the launch it started with.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, assume, given, settings

from herd_operator.specs import load_spec_file
from tests.fuzzing import ODD_DOCUMENTS, spec_bytes
from tests.integration.harness import OperatorHarness, spec_document

GOOD = "keeper"
# A job that holds Running without costing the shared machine anything.
GOOD_COMMAND = ["python", "-c", "import time; time.sleep(900)"]
CLAIMS_ON_THE_GOOD_JOB = (
    yaml.safe_dump(spec_document(GOOD, 1, 1, GOOD_COMMAND, priority="high")),
    yaml.safe_dump(spec_document(GOOD, 0, 1, GOOD_COMMAND)),
    f"apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {{name: {GOOD}}}\n"
    "spec: !!python/object/apply:builtins.print ['fuzz']\n",
)
EVIDENCE_TIMEOUT_S = 30.0
"""Hang guard for one file to be noticed; never a speed expectation."""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in list(self.records)]

    def problems(self) -> list[str]:
        """Records that show a bug: a traceback or an ERROR."""
        return [
            f"{record.levelname} {record.name}: {record.getMessage()[:500]}"
            for record in list(self.records)
            if record.exc_info
            or record.levelno >= logging.ERROR
            or "Traceback" in record.getMessage()
        ]


@pytest.fixture
def log() -> Iterator[Records]:
    records = Records()
    root = logging.getLogger()
    level = root.level
    root.addHandler(records)
    root.setLevel(min(level, logging.WARNING))
    try:
        yield records
    finally:
        root.removeHandler(records)
        root.setLevel(level)


def write_atomically(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    temporary = directory / f".{name}.tmp"
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return path


def is_invalid(data: bytes) -> bool:
    """Whether the operator will refuse these bytes; checked apart from the operator, so
    that no generated file is ever started as a job."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "probe.yaml"
        path.write_bytes(data)
        return not load_spec_file(path).valid


def noticed(herd: OperatorHarness, log: Records, file_name: str) -> bool:
    """Whether the operator has said that this file is a bad spec, anywhere."""
    if any(file_name in message for message in log.messages()):
        return True
    if any(file_name in event.message for event in herd.events()):
        return True
    condition = herd.condition(GOOD, "SpecValid")
    return condition is not None and file_name in condition["message"]


class Fuzzer:
    """Writes each file, waits until the operator reports it, then removes it."""

    def __init__(self, herd: OperatorHarness, log: Records) -> None:
        self.herd = herd
        self.log = log
        self.numbers = itertools.count(1)
        self.written = 0

    def drop(self, data: bytes) -> None:
        file_name = f"fuzz-{next(self.numbers):04d}.yaml"
        path = write_atomically(self.herd.specs_dir, file_name, data)
        self.written += 1
        try:
            self.herd.wait_for(
                lambda: noticed(self.herd, self.log, file_name),
                f"the operator to report {file_name} ({data[:200]!r}) as a bad spec",
                timeout=EVIDENCE_TIMEOUT_S,
            )
        finally:
            path.unlink()
        assert self.log.problems() == [], f"after {file_name} ({data[:200]!r})"


@pytest.fixture
def running_good_job(herd: OperatorHarness) -> str:
    """Start the good job; return its launch id."""
    herd.write_spec(spec_document(GOOD, 1, 1, GOOD_COMMAND))
    herd.wait_for(
        lambda: (c := herd.condition(GOOD, "Running")) and c["status"] == "True",
        "the good job to run",
        job=GOOD,
    )
    launch = herd.launch_id(GOOD)
    assert launch
    return launch


def test_bad_spec_files_dropped_live_never_hurt_the_operator_or_the_running_job(
    herd: OperatorHarness, log: Records, running_good_job: str
) -> None:
    fuzzer = Fuzzer(herd, log)

    # The hand-written odd documents, every one of them.
    for document in ODD_DOCUMENTS:
        data = document.encode("utf-8")
        if is_invalid(data):
            fuzzer.drop(data)

    # Bad files that claim the running job's name: the job keeps its last good spec.
    for claim in CLAIMS_ON_THE_GOOD_JOB:
        assert is_invalid(claim.encode())
        fuzzer.drop(claim.encode())
        running = herd.condition(GOOD, "Running")
        assert running is not None and running["status"] == "True"

    # Then a fixed sequence of generated ones; no shrinking (a live operator is slow to
    # replay), and the failing file is in the assertion message anyway.
    @settings(
        max_examples=150,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much,
        ],
    )
    @given(data=spec_bytes())
    def drop_generated(data: bytes) -> None:
        assume(is_invalid(data))
        fuzzer.drop(data)

    drop_generated()
    assert fuzzer.written >= 100, f"only {fuzzer.written} bad files were written"
    print(f"{fuzzer.written} bad spec files written and reported")

    # The operator and the good job came through it all.
    assert herd.operator.ready.is_set()
    thread_alive = herd._thread.is_alive()
    assert thread_alive, "the operator's thread died"
    unexpected = herd.operator.metrics.registry.get_sample_value(
        "herd_reconcile_total", {"outcome": "unexpected_error"}
    )
    assert not unexpected, f"{unexpected} reconciles ended in an unexpected error"
    assert log.problems() == []
    herd.wait_for(
        lambda: (c := herd.condition(GOOD, "SpecValid")) and c["status"] == "True",
        "the good job's spec to be valid",
        job=GOOD,
    )
    running = herd.condition(GOOD, "Running")
    assert running is not None and running["status"] == "True", herd.diagnostics(GOOD)
    assert herd.launch_id(GOOD) == running_good_job, "the good job was relaunched"
    assert sorted(p.name for p in herd.specs_dir.iterdir()) == [f"{GOOD}.yaml"]
