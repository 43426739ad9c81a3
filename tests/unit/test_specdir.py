"""The spec directory: relist reports exactly the names whose view changed."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator.runtime import specdir as specdir_module
from herd_operator.runtime.specdir import SpecDirectory
from herd_operator.specs import HerdJob, SpecFile, load_spec_file
from herd_operator.specs.loading import load_spec_descriptor

# Every write gets a distinct mtime, so the stat cache sees each edit even when the
# file system's clock is coarser than the test (same size, same tick).
_mtimes = itertools.count(1_700_000_000_000_000_000, 1_000_000_000)


def spec_text(name: str, high: int = 4, *, low: int = 1, extra: str = "") -> str:
    return (
        f"{extra}apiVersion: herd/v1alpha1\n"
        "kind: HerdJob\n"
        f"metadata:\n  name: {name}\n"
        "spec:\n"
        "  command: [python, train.py]\n"
        f"  gpus:\n    min: {low}\n    max: {high}\n"
    )


def write(path: Path, text: str) -> None:
    """Write like users are asked to: a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    stamp = next(_mtimes)
    os.utime(tmp, ns=(stamp, stamp))
    os.replace(tmp, path)


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs"
    directory.mkdir()
    return directory


@pytest.fixture
def specs(jobs: Path) -> SpecDirectory:
    return SpecDirectory(jobs)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """File names that relist loaded, in order."""
    loaded: list[str] = []

    def counting(descriptor: int, path: Path) -> SpecFile:
        loaded.append(path.name)
        return load_spec_descriptor(descriptor, path)

    monkeypatch.setattr(specdir_module, "load_spec_descriptor", counting)
    yield loaded


def test_new_file_is_changed_then_quiet(jobs: Path, specs: SpecDirectory) -> None:
    write(jobs / "train.yaml", spec_text("train"))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None
    assert view.job is not None
    assert view.path == str(jobs / "train.yaml")
    assert view.job.spec.gpus.max == 4
    assert specs.relist() == set()
    assert specs.names() == ["train"]


def test_content_edit_is_changed(jobs: Path, specs: SpecDirectory) -> None:
    write(jobs / "train.yaml", spec_text("train", 4))
    specs.relist()
    write(jobs / "train.yaml", spec_text("train", 3))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None and view.job is not None
    assert view.job.spec.gpus.max == 3


def test_formatting_only_edit_is_not_changed(
    jobs: Path, specs: SpecDirectory, reads: list[str]
) -> None:
    write(jobs / "train.yaml", spec_text("train"))
    specs.relist()
    # A comment and a label: the file is re-read, but the spec's fingerprint is the same.
    reformatted = spec_text("train", extra="# tuned on Tuesday\n").replace(
        "  name: train\n", "  name: train\n  labels: {team: vision}\n"
    )
    write(jobs / "train.yaml", reformatted)
    assert specs.relist() == set()
    assert reads == ["train.yaml", "train.yaml"]


def test_invalid_edit_is_changed_and_has_no_job(jobs: Path, specs: SpecDirectory) -> None:
    path = jobs / "train.yaml"
    write(path, spec_text("train"))
    specs.relist()
    write(path, spec_text("train", low=0))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None
    assert view.job is None
    assert view.path == str(path)
    assert view.errors == (f"{path}: spec.gpus.min: must be at least 1, got integer 0",)
    # Fixing it is a change again.
    write(path, spec_text("train"))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None and view.job is not None and view.errors == ()


def test_ignored_file_names(jobs: Path, specs: SpecDirectory, reads: list[str]) -> None:
    write(jobs / ".hidden.yaml", spec_text("hidden"))
    write(jobs / "notes.txt", spec_text("notes"))
    write(jobs / "train.yaml~", spec_text("backup"))
    write(jobs / "#train.yaml#", spec_text("autosave"))
    write(jobs / ".train.yaml.swp", spec_text("swap"))
    (jobs / "folder.yaml").mkdir()
    assert specs.relist() == set()
    assert specs.names() == []
    assert reads == []
    write(jobs / "real.YML", spec_text("real"))
    assert specs.relist() == {"real"}
    assert reads == ["real.YML"]


def test_deleted_file_is_changed_and_view_gone(jobs: Path, specs: SpecDirectory) -> None:
    write(jobs / "train.yaml", spec_text("train"))
    write(jobs / "other.yaml", spec_text("other"))
    specs.relist()
    (jobs / "train.yaml").unlink()
    assert specs.relist() == {"train"}
    assert specs.view("train") is None
    assert specs.names() == ["other"]


def test_renaming_a_file_is_a_change_of_path(jobs: Path, specs: SpecDirectory) -> None:
    write(jobs / "train.yaml", spec_text("train"))
    specs.relist()
    os.replace(jobs / "train.yaml", jobs / "renamed.yaml")
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None and view.path == str(jobs / "renamed.yaml")


def test_duplicate_names_make_both_files_invalid(jobs: Path, specs: SpecDirectory) -> None:
    write(jobs / "a.yaml", spec_text("train"))
    specs.relist()
    write(jobs / "b.yaml", spec_text("train", 2))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None
    assert view.job is None
    assert view.errors == (
        f"{jobs / 'a.yaml'}: metadata.name: 'train' is also declared in b.yaml",
        f"{jobs / 'b.yaml'}: metadata.name: 'train' is also declared in a.yaml",
    )
    (jobs / "b.yaml").unlink()
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None and view.job is not None and view.job.spec.gpus.max == 4


def test_unnamed_broken_file_is_reported_apart(
    jobs: Path, specs: SpecDirectory, caplog: pytest.LogCaptureFixture
) -> None:
    write(jobs / "broken.yaml", "spec: [unclosed\n")
    with caplog.at_level(logging.WARNING, logger="herd_operator.runtime.specdir"):
        assert specs.relist() == set()
        assert specs.relist() == set()  # logged once, not on every relist
    assert specs.names() == []
    (record,) = caplog.records
    assert record.getMessage().startswith(
        f"invalid spec file: {jobs / 'broken.yaml'}: (file): YAML syntax error at line 2"
    )


def test_syntax_error_in_a_known_file_keeps_the_name_as_invalid(
    jobs: Path, specs: SpecDirectory
) -> None:
    path = jobs / "train.yaml"
    write(path, spec_text("train"))
    specs.relist()
    write(path, spec_text("train").replace("[python, train.py]", "[python, train.py"))
    assert specs.relist() == {"train"}
    view = specs.view("train")
    assert view is not None
    assert view.job is None
    assert view.errors and view.errors[0].startswith(f"{path}: (file): YAML syntax error")


def test_missing_directory_means_no_jobs(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    specs = SpecDirectory(jobs)
    assert specs.relist() == set()
    jobs.mkdir()
    write(jobs / "train.yaml", spec_text("train"))
    assert specs.relist() == {"train"}
    (jobs / "train.yaml").unlink()
    jobs.rmdir()
    assert specs.relist() == {"train"}
    assert specs.view("train") is None


def test_files_are_reread_only_when_their_stat_changes(
    jobs: Path, specs: SpecDirectory, reads: list[str]
) -> None:
    write(jobs / "a.yaml", spec_text("a"))
    write(jobs / "b.yaml", spec_text("b"))
    specs.relist()
    assert reads == ["a.yaml", "b.yaml"]
    specs.relist()
    specs.relist()
    assert reads == ["a.yaml", "b.yaml"]
    stamp = next(_mtimes)
    os.utime(jobs / "b.yaml", ns=(stamp, stamp))
    assert specs.relist() == set()
    assert reads == ["a.yaml", "b.yaml", "b.yaml"]
    write(jobs / "a.yaml", spec_text("a", 2))
    assert specs.relist() == {"a"}
    assert reads == ["a.yaml", "b.yaml", "b.yaml", "a.yaml"]


def test_a_value_yaml_cannot_build_leaves_the_other_specs_running(
    jobs: Path, specs: SpecDirectory, caplog: pytest.LogCaptureFixture
) -> None:
    """One file with `priority: 2024-02-30` once froze every relist (a traceback each time)."""
    write(jobs / "good.yaml", spec_text("good"))
    write(jobs / "bad.yaml", spec_text("bad") + "  priority: 2024-02-30\n")
    with caplog.at_level(logging.WARNING):
        assert specs.relist() == {"good"}
        good = specs.view("good")
        assert good is not None and good.job is not None
        assert specs.view("bad") is None  # the file could not be read far enough to name it
        write(jobs / "later.yaml", spec_text("later"))
        assert specs.relist() == {"later"}  # new specs still start
    warnings = [r.getMessage() for r in caplog.records if "bad.yaml" in r.getMessage()]
    assert len(warnings) == 1, warnings  # said once, not on every relist
    assert "'2024-02-30' is not a valid timestamp" in warnings[0]


def test_an_invalid_name_in_a_running_jobs_file_keeps_the_job(
    jobs: Path, specs: SpecDirectory
) -> None:
    """`name: alpha` -> `name: ALPHA` once deleted the running job alpha."""
    write(jobs / "a.yaml", spec_text("alpha"))
    assert specs.relist() == {"alpha"}
    write(jobs / "a.yaml", spec_text("ALPHA"))
    assert specs.relist() == {"alpha"}
    view = specs.view("alpha")
    assert view is not None and view.job is None  # invalid now: the last good spec runs on
    assert any("metadata.name" in error for error in view.errors), view.errors
    assert specs.view("ALPHA") is None
    write(jobs / "a.yaml", spec_text("beta"))  # a valid new name is a new job
    assert specs.relist() == {"alpha", "beta"}
    assert specs.view("alpha") is None


def test_entries_that_are_not_regular_files_in_the_dir_are_skipped_and_said_once(
    jobs: Path, specs: SpecDirectory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "secret.yaml"
    secret.write_text("token: 0123456789abcdef\n")
    write(jobs / "good.yaml", spec_text("good"))
    write(jobs / "inside.yaml", spec_text("inside"))
    os.mkfifo(jobs / "fifo.yaml")
    (jobs / "dir.yaml").mkdir()
    (jobs / "out.yaml").symlink_to(secret)
    (jobs / "dangling.yaml").symlink_to(jobs / "gone.yaml")
    (jobs / "again.yaml").symlink_to(jobs / "inside.yaml")  # a link inside the dir is read
    with caplog.at_level(logging.WARNING):
        assert specs.relist() == {"good", "inside"}
        assert specs.relist() == set()
    said = sorted(r.getMessage() for r in caplog.records if "skipping" in r.getMessage())
    assert said == [
        "spec directory: skipping dangling.yaml: a dangling link",
        "spec directory: skipping dir.yaml: not a regular file (a directory)",
        "spec directory: skipping fifo.yaml: not a regular file (a FIFO)",
        f"spec directory: skipping out.yaml: a link to {secret}, outside the spec directory",
    ]
    assert not any("0123456789abcdef" in r.getMessage() for r in caplog.records)
    inside = specs.view("inside")
    assert inside is not None and inside.errors  # declared twice (inside.yaml, again.yaml)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A file swapped for a FIFO between listing and open once hung the relist forever."""
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    loaded: list[SpecFile] = []
    reader = threading.Thread(target=lambda: loaded.append(load_spec_file(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    assert loaded, "opening the FIFO blocked"
    assert [str(e) for e in loaded[0].errors] == [
        f"{fifo}: (file): not a regular file (a FIFO); not read"
    ]


def test_a_name_too_long_for_a_job_keeps_the_running_job_too(
    jobs: Path, specs: SpecDirectory
) -> None:
    write(jobs / "a.yaml", spec_text("alpha"))
    specs.relist()
    write(jobs / "a.yaml", spec_text("a" * 64))  # the pattern holds, the length does not
    assert specs.relist() == {"alpha"}
    view = specs.view("alpha")
    assert view is not None and view.job is None


def test_spec_files_of_other_users_are_not_read_and_a_shared_dir_is_said_once(
    jobs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A spec's command runs as the operator's user: only that user's files may declare one.

    The directory is made to belong to someone else by telling it another owner uid (a
    test cannot make files of another user without root).
    """
    write(jobs / "mine.yaml", spec_text("mine"))
    jobs.chmod(0o777)
    stranger = SpecDirectory(jobs, owner_uid=os.geteuid() + 1)
    with caplog.at_level(logging.WARNING):
        assert stranger.relist() == set()
        assert stranger.relist() == set()
    said = [r.getMessage() for r in caplog.records]
    assert sum("writable by other users (mode 777)" in m for m in said) == 1, said
    assert sum("skipping mine.yaml: owned by uid" in m for m in said) == 1, said
    jobs.chmod(0o700)
    assert SpecDirectory(jobs).relist() == {"mine"}, "the owner's own files are read"


def test_an_unchanged_file_costs_no_fingerprint_on_a_relist(
    jobs: Path, specs: SpecDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fingerprinted: list[str] = []
    original = specdir_module.spec_fingerprint

    def counting(job: HerdJob) -> str:
        fingerprinted.append(job.name)
        return original(job)

    monkeypatch.setattr(specdir_module, "spec_fingerprint", counting)
    write(jobs / "a.yaml", spec_text("a"))
    write(jobs / "b.yaml", spec_text("b"))
    specs.relist()
    view = specs.view("a")
    assert sorted(fingerprinted) == ["a", "b"]
    specs.relist()
    specs.relist()
    assert sorted(fingerprinted) == ["a", "b"]
    assert specs.view("a") == view
    write(jobs / "a.yaml", spec_text("a", 2))
    specs.relist()
    assert sorted(fingerprinted) == ["a", "a", "b"]


def test_a_policy_or_engine_this_operator_lacks_is_a_spec_error_where_specs_are_loaded(
    jobs: Path, specs: SpecDirectory
) -> None:
    write(jobs / "p.yaml", spec_text("p") + "  policy:\n    name: no-such-policy\n")
    write(
        jobs / "m.yaml",
        spec_text("m") + "  policy:\n    name: memory\n    params: {low: 0.9, high: 0.1}\n",
    )
    write(jobs / "e.yaml", spec_text("e") + "  engine:\n    kind: no-such-engine\n")
    write(jobs / "ok.yaml", spec_text("ok"))

    specs.relist()

    for name, field in [
        ("p", "spec.policy.name"),
        ("m", "spec.policy.params"),
        ("e", "spec.engine"),
    ]:
        view = specs.view(name)
        assert view is not None and view.job is None, name
        assert any(f"{name}.yaml: {field}" in error for error in view.errors), view.errors
    ok = specs.view("ok")
    assert ok is not None and ok.job is not None
