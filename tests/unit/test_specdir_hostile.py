"""Hostile entries in the spec directory (issue 27): links that loop, FIFOs, sockets, links
out of the directory, files of another user, directories named like specs, and any of them
moved over a running job's file. Each is skipped and said once; no other spec stops being
read; a job whose file became one keeps its last good spec (as after an invalid edit), and
only an entry that is gone deletes the job."""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from herd_operator.runtime.specdir import DirectoryWatcher, SpecDirectory, problems_as_events
from herd_operator.runtime.store import Store, StoreError
from tests.fuzzing import (
    HOSTILE_ENTRIES,
    INTRUDER,
    INTRUDER_TEXT,
    chown_refused,
    put_hostile,
    remove_entry,
)
from tests.unit.test_specdir import spec_text, write

CHOWN_REFUSED = chown_refused()
KINDS = sorted(HOSTILE_ENTRIES)
KINDS_HERE = [kind for kind in KINDS if kind != "other-user" or CHOWN_REFUSED is None]
LOOP = "a symlink loop, or a chain of links too long to follow"


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs"
    directory.mkdir()
    return directory


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A readable spec outside the directory, that a link may lead to."""
    path = tmp_path / "elsewhere.yaml"
    path.write_text(INTRUDER_TEXT)
    return path


def skipped_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]


def test_links_that_loop_are_skipped_once_and_every_other_spec_is_still_read(
    jobs: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A self-referencing link made `Path.resolve()` raise `RuntimeError: Symlink loop` in
    every relist: no spec was added, changed or deleted while it was there."""
    specs = SpecDirectory(jobs)
    write(jobs / "good.yaml", spec_text("good"))
    write(jobs / "gone-soon.yaml", spec_text("gone-soon"))
    for kind in ("self-loop", "loop-of-two", "chain-too-long"):
        put_hostile(jobs / f"{kind}.yaml", kind, outside)
    with caplog.at_level(logging.WARNING):
        assert specs.relist() == {"good", "gone-soon"}
        # A new file that sorts before the loops, an edit and a deletion: all seen.
        write(jobs / "a-new.yaml", spec_text("a-new"))
        write(jobs / "good.yaml", spec_text("good", 2))
        (jobs / "gone-soon.yaml").unlink()
        assert specs.relist() == {"a-new", "good", "gone-soon"}
        for _ in range(3):
            assert specs.relist() == set()
    assert specs.names() == ["a-new", "good"]
    assert sorted(skipped_said(caplog)) == [
        f"spec directory: skipping chain-too-long.yaml: {LOOP}",
        f"spec directory: skipping loop-of-two.yaml: {LOOP}",
        f"spec directory: skipping self-loop.yaml: {LOOP}",
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_skipped_entry_moved_over_a_jobs_file_keeps_the_job_on_its_last_good_spec(
    jobs: Path, outside: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It was `spec deleted: stopping the job`; an invalid edit keeps the last good spec,
    and so must an entry the operator will not read."""
    if kind == "other-user" and CHOWN_REFUSED is not None:
        pytest.skip(CHOWN_REFUSED)
    specs = SpecDirectory(jobs)
    path = jobs / "job.yaml"
    write(path, spec_text("train"))
    assert specs.relist() == {"train"}

    put_hostile(path, kind, outside)
    with caplog.at_level(logging.WARNING):
        assert specs.relist() == {"train"}
        assert specs.relist() == set()  # the same skip: no change, and said once
    view = specs.view("train")
    assert view is not None, "the job would be deleted"
    assert view.job is None and view.path == str(path)
    assert len(view.errors) == 1 and view.errors[0].startswith(f"{path}: (file): not read: ")
    assert HOSTILE_ENTRIES[kind][1] in view.errors[0], view.errors
    assert len(skipped_said(caplog)) == 1, skipped_said(caplog)
    assert INTRUDER not in specs.names()

    # A good file again: the spec is valid again.
    remove_entry(path)
    write(path, spec_text("train"))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None and view.job is not None and view.errors == ()

    # A hostile entry again, then the entry gone: only now is the job deleted.
    put_hostile(path, kind, outside)
    assert specs.relist() == {"train"}
    remove_entry(path)
    assert specs.relist() == {"train"}
    assert specs.view("train") is None
    assert specs.relist() == set()


def test_an_entry_skipped_for_another_reason_is_said_again_and_only_then(
    jobs: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    specs = SpecDirectory(jobs)
    path = jobs / "odd.yaml"
    with caplog.at_level(logging.WARNING):
        for kind in ("fifo", "fifo", "link-out", "link-out", "self-loop"):
            put_hostile(path, kind, outside)
            specs.relist()
            specs.relist()
    assert skipped_said(caplog) == [
        "spec directory: skipping odd.yaml: not a regular file (a FIFO)",
        f"spec directory: skipping odd.yaml: a link to {outside}, outside the spec directory",
        f"spec directory: skipping odd.yaml: {LOOP}",
    ]


def test_a_problem_with_a_file_that_names_no_job_is_reported_once(jobs: Path) -> None:
    """A YAML error that stops the name being read was only in the operator's log: the
    operator records what `on_problem` is told as an event (`herd-operator events`)."""
    problems: list[tuple[str, str]] = []
    specs = SpecDirectory(jobs, on_problem=lambda *problem: problems.append(problem))
    write(jobs / "broken.yaml", "spec: [unclosed\n")
    os.mkfifo(jobs / "fifo.yaml")
    write(jobs / "good.yaml", spec_text("good"))
    assert specs.relist() == {"good"}
    assert specs.relist() == set()
    assert [reason for reason, _ in problems] == ["SpecFileSkipped", "InvalidSpecFile"]
    assert problems[0][1] == f"{jobs / 'fifo.yaml'}: not read: not a regular file (a FIFO)"
    assert problems[1][1].startswith(
        f"{jobs / 'broken.yaml'}: (file): YAML syntax error at line 2"
    ), problems
    write(jobs / "broken.yaml", "spec: 'unclosed\n")  # another error: said again
    specs.relist()
    assert len(problems) == 3 and problems[2][0] == "InvalidSpecFile"


def test_a_file_moved_over_the_entry_between_its_check_and_its_read_is_not_read(
    jobs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is read must be the file whose kind and owner were checked: the live fuzz once
    had a chain of links replaced by the good file between `resolve()` and the stat, read
    the chain's target (another job's spec) as the job's file, and deleted the job."""
    specs = SpecDirectory(jobs)
    path = jobs / "job.yaml"
    write(path, spec_text("train", 4))
    assert specs.relist() == {"train"}
    write(path, spec_text("train", 2))
    intruder = jobs / ".intruder"
    intruder.write_text(INTRUDER_TEXT)
    examine = SpecDirectory._examine

    def examined_then_moved_over(
        entry: os.DirEntry[str], directory: Path
    ) -> tuple[Path, os.stat_result] | str | None:
        result = examine(entry, directory)
        if entry.name == "job.yaml" and intruder.exists():
            os.replace(intruder, path)  # after the check, before the read
        return result

    monkeypatch.setattr(SpecDirectory, "_examine", staticmethod(examined_then_moved_over))
    assert specs.relist() == set()  # neither the intruder read nor the job taken for deleted
    view = specs.view("train")
    assert view is not None and view.job is not None and view.job.spec.gpus.max == 4
    assert specs.names() == ["train"]
    # The next relist reads what is there now, checked: here a spec of the same user.
    assert specs.relist() == {"train", INTRUDER}


def test_the_operator_records_each_problem_as_an_event_of_no_job_and_a_full_disk_stops_nothing(
    jobs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "state.db")
    specs = SpecDirectory(jobs, on_problem=problems_as_events(store))
    write(jobs / "broken.yaml", "spec: [unclosed\n")
    specs.relist()
    ((job, type_, reason, message),) = [
        (e.job, e.type, e.reason, e.message) for e in store.events()
    ]
    assert (job, type_, reason) == (None, "Warning", "InvalidSpecFile")
    assert message.startswith(f"{jobs / 'broken.yaml'}: (file): YAML syntax error")

    class FullDisk:
        def add_event(self, *args: object) -> None:
            raise StoreError("database or disk is full")

    specs = SpecDirectory(jobs, on_problem=problems_as_events(FullDisk()))  # type: ignore[arg-type]
    write(jobs / "good.yaml", spec_text("good"))
    with caplog.at_level(logging.WARNING):
        assert specs.relist() == {"good"}
    assert any("could not record" in r.getMessage() for r in caplog.records)


def test_the_relists_own_reads_of_files_do_not_wake_it_again(
    jobs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watchdog reports a file opened and closed unchanged: the relist that read a file woke
    itself again, and one that failed before caching what it read (a link loop) never
    rested (~800 relists a second)."""
    specs = SpecDirectory(jobs)
    watcher = DirectoryWatcher(specs, lambda changed: None, relist_seconds=3600.0)
    seen: list[str] = []
    lock = threading.Lock()
    file_event = watcher._file_event

    def recorded(event_type: str) -> None:
        with lock:
            seen.append(event_type)
        file_event(event_type)

    monkeypatch.setattr(watcher, "_file_event", recorded)
    monkeypatch.setattr(watcher._loop, "wake", lambda: seen.append("WAKE"))
    watcher.start()
    try:
        if watcher._observer is None:
            pytest.skip("no file events (inotify) here")
        write(jobs / "a.yaml", spec_text("a"))
        assert specs.relist() == {"a"}  # reads a.yaml: opened, closed unchanged
        (jobs / ".sentinel").mkdir()  # its event comes after the reads' (one inotify queue)
        deadline = threading.Event()
        for _ in range(600):  # a hang guard of 60 s, not a speed expectation
            with lock:
                if seen.count("created") >= 2:
                    break
            deadline.wait(0.1)
    finally:
        watcher.stop()
    with lock:
        events = list(seen)
    assert events.count("created") >= 2, events
    read_only = {"opened", "closed_no_write"}
    assert read_only & set(events), f"watchdog reported no reads here: {events}"
    woken_by = [events[i - 1] for i, event in enumerate(events) if event == "WAKE"]
    assert not read_only & set(woken_by), events
    assert "created" in woken_by, events


# ---- The fuzz: any sequence of writes, hostile entries, deletions and relists ----

FILES = ("a.yaml", "b.yaml", "c.yaml")
# "known": a good file, then a relist (its job is known: what follows may be a swap over it).
ACTIONS = ("good", "known", "known", "delete", "relist", "relist", *KINDS_HERE)
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Counted(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def said() -> Iterator[Counted]:
    handler = Counted()
    logger = logging.getLogger("herd_operator.runtime.specdir")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Tally:
    def __init__(self) -> None:
        self.entries = self.swaps = self.relists = self.examples = 0


def expect(specs: SpecDirectory, present: dict[str, str], declared: set[str]) -> None:
    """Each file's job as the model says: a good file's job has its spec; a hostile entry
    where a job's file was keeps that job, invalid; anything else declares nothing."""
    for file in FILES:
        name, state = file.removesuffix(".yaml"), present.get(file)
        view = specs.view(name)
        if state == "good":
            assert view is not None and view.job is not None, (file, view)
        elif state is not None and file in declared:
            assert view is not None and view.job is None, (file, state, view)
            assert HOSTILE_ENTRIES[state][1] in view.errors[0], (state, view.errors)
        else:
            assert view is None, (file, state, view)
    assert INTRUDER not in specs.names()


def run_steps(steps: list[tuple[str, str]], tally: Tally, said: Counted) -> None:
    with tempfile.TemporaryDirectory() as root:
        jobs, outside = Path(root) / "jobs", Path(root) / "elsewhere.yaml"
        jobs.mkdir()
        outside.write_text(INTRUDER_TEXT)
        problems: list[tuple[str, str]] = []
        specs = SpecDirectory(jobs, on_problem=lambda *problem: problems.append(problem))
        present: dict[str, str] = {}
        declared: set[str] = set()  # files whose job the directory knows (the model)
        sizes = itertools.cycle(range(1, 5))
        for action, file in [*steps, ("relist", FILES[0])]:
            path = jobs / file
            if action in ("good", "known"):
                remove_entry(path)
                write(path, spec_text(file.removesuffix(".yaml"), next(sizes)))
                present[file] = "good"
            elif action == "delete":
                remove_entry(path)
                present.pop(file, None)
            if action in ("relist", "known"):
                specs.relist()
                tally.relists += 1
                for name in FILES:
                    if present.get(name) == "good":
                        declared.add(name)
                    elif name not in present:
                        declared.discard(name)
                expect(specs, present, declared)
            elif action in HOSTILE_ENTRIES:
                tally.swaps += file in declared  # over the file of a job it knows
                put_hostile(path, action, outside)
                present[file] = action
                tally.entries += 1
        before = len(said.messages)
        assert specs.relist() == set() and specs.relist() == set()
        assert len(said.messages) == before, said.messages[before:]  # nothing said twice
        skips = [message for reason, message in problems if reason == "SpecFileSkipped"]
        assert len(skips) == sum("skipping" in message for message in said.messages)
    tally.examples += 1


def test_fuzzed_hostile_entries_never_stop_a_relist_nor_delete_a_job(said: Counted) -> None:
    """Sequences of good files, hostile entries (`tests.fuzzing.HOSTILE_ENTRIES`), some
    moved over a known job's file, deletions and relists: no relist fails, every job's view
    is what the model says, nothing is said twice, and the intruder's spec is never read."""
    tally = Tally()

    @FUZZ
    @given(
        steps=st.lists(
            st.tuples(st.sampled_from(ACTIONS), st.sampled_from(FILES)), min_size=20, max_size=40
        )
    )
    def fuzz(steps: list[tuple[str, str]]) -> None:
        said.messages.clear()
        run_steps(steps, tally, said)

    fuzz()
    print(
        f"{tally.examples} sequences: {tally.entries} hostile entries ({len(KINDS_HERE)} kinds),"
        f" {tally.swaps} of them over a known job's file, {tally.relists} relists"
    )
    assert tally.entries >= 1000 and tally.swaps >= 400, vars(tally)
