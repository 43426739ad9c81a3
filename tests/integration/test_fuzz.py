"""Bad spec files and hostile entries dropped live into the directory of a running operator.

One good job runs the whole time. Hypothesis writes odd and broken spec files (see
tests/fuzzing.py) one at a time, atomically, as users are told to; each must show up as
a spec problem that names its file (a warning in the log, an InvalidSpec event or a
SpecValid=False condition), and nothing may go wrong inside the operator: its thread
lives, its log holds no traceback and no ERROR, no reconcile ends in an unexpected error,
and the good job is still running the launch it started with. Then entries that are no
files (links that loop or lead out, FIFOs, sockets, directories, files of another user)
are made beside the job's file and moved over it: the same must hold (issue 27).
"""

from __future__ import annotations

import functools
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
from tests.fuzzing import (
    HOSTILE_ENTRIES,
    INTRUDER,
    INTRUDER_TEXT,
    ODD_DOCUMENTS,
    chown_refused,
    put_file,
    put_hostile,
    remove_entry,
    remove_partners,
    spec_bytes,
)
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


ROUNDS_OF_HOSTILE_ENTRIES = 3


def skip_event_for(herd: OperatorHarness, path: Path) -> bool:
    return any(
        e.reason == "SpecFileSkipped" and f"{path}: not read: " in e.message for e in herd.events()
    )


def spec_invalid_for(herd: OperatorHarness, path: Path, reason: str) -> bool:
    condition = herd.condition(GOOD, "SpecValid")
    return (
        condition is not None
        and condition["status"] == "False"
        and f"{path}: (file): not read: " in condition["message"]
        and reason in condition["message"]
    )


def spec_valid(herd: OperatorHarness) -> bool:
    condition = herd.condition(GOOD, "SpecValid")
    return condition is not None and condition["status"] == "True"


def test_hostile_entries_and_swaps_over_the_running_jobs_file_never_disturb_it(
    herd: OperatorHarness, log: Records, running_good_job: str
) -> None:
    """Each kind of hostile entry three times: new beside the job's file (skipped, and said in an
    event naming it), then moved over the job's file in one step (the job runs on with its
    last good spec, SpecValid=False saying which file and why, an InvalidSpec event), then
    the good file back (SpecValid=True). A link loop once stopped every relist, and any of
    these over the job's file once deleted the job."""
    kinds = sorted(HOSTILE_ENTRIES)
    if (refused := chown_refused()) is not None:
        kinds.remove("other-user")
        print(f"other-user left out: {refused}")
    outside = herd.root / "elsewhere.yaml"
    outside.write_text(INTRUDER_TEXT)
    keeper = herd.specs_dir / f"{GOOD}.yaml"
    good_text = keeper.read_text()
    entries = swaps = 0
    made: list[Path] = []  # kept until the end: later swaps happen among all of them
    for round_number in range(ROUNDS_OF_HOSTILE_ENTRIES):
        for kind in kinds:
            reason = HOSTILE_ENTRIES[kind][1]
            path = herd.specs_dir / f"hostile-{round_number}-{kind}.yaml"
            put_hostile(path, kind, outside)
            made.append(path)
            entries += 1
            herd.wait_for(
                functools.partial(skip_event_for, herd, path),
                f"an event saying {path.name} ({kind}) is skipped",
                timeout=EVIDENCE_TIMEOUT_S,
            )
            put_hostile(keeper, kind, outside)
            swaps += 1
            herd.wait_for(
                functools.partial(spec_invalid_for, herd, keeper, reason),
                f"SpecValid=False naming {keeper.name} as {kind}",
                timeout=EVIDENCE_TIMEOUT_S,
                job=GOOD,
            )
            put_file(keeper, good_text)
            herd.wait_for(
                lambda: spec_valid(herd), "SpecValid=True again", EVIDENCE_TIMEOUT_S, GOOD
            )
            assert herd.launch_id(GOOD) == running_good_job, f"relaunched after {kind}"
            assert log.problems() == [], f"after {kind}"
            remove_partners(keeper)
    for path in made:
        remove_entry(path)
        remove_partners(path)
    print(f"{entries} hostile entries made, {swaps} moved over the running job's file")

    assert herd._thread.is_alive(), "the operator's thread died"
    unexpected = herd.operator.metrics.registry.get_sample_value(
        "herd_reconcile_total", {"outcome": "unexpected_error"}
    )
    assert not unexpected, f"{unexpected} reconciles ended in an unexpected error"
    running = herd.condition(GOOD, "Running")
    assert running is not None and running["status"] == "True", herd.diagnostics(GOOD)
    assert herd.launch_id(GOOD) == running_good_job, "the good job was relaunched"
    assert herd.job(INTRUDER) is None, "a hostile entry's spec was read"
    invalid = [e for e in herd.events(GOOD) if e.reason == "InvalidSpec"]
    assert sum(e.count for e in invalid) >= swaps, herd.diagnostics(GOOD)
    assert not any("spec deleted" in e.message for e in herd.events(GOOD))
    herd.wait_for(
        lambda: sorted(p.name for p in herd.specs_dir.iterdir()) == [keeper.name],
        "the directory to hold the job's file only",
        timeout=EVIDENCE_TIMEOUT_S,
    )


def test_a_file_whose_job_name_cannot_be_read_is_an_event(herd: OperatorHarness) -> None:
    """A YAML error that stops the name being read was only in the operator's log; now
    `herd-operator events` shows it, naming the file."""
    path = herd.write_text("broken.yaml", "metadata: {name: [unclosed\n")
    events = herd.wait_for(
        lambda: [e for e in herd.events() if e.reason == "InvalidSpecFile"],
        "an InvalidSpecFile event",
        timeout=EVIDENCE_TIMEOUT_S,
    )
    (event,) = events
    assert (event.job, event.type) == (None, "Warning")
    assert event.message.startswith(f"{path}: (file): YAML syntax error"), event.message
