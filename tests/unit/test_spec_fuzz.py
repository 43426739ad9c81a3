"""Fuzzing `herd_operator.specs.loading` directly: any bytes in a spec file become SpecErrors, never an
exception, and never the catch-all "cannot be loaded" that marks an unforeseen one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from herd_operator.specs import (
    SpecFile,
    index_specs,
    load_spec_file,
    load_spec_text,
    spec_fingerprint,
)
from herd_operator.specs.loading import FILE_FIELD, SpecError
from tests.fuzzing import (
    DUPLICATE_KEY_DOCUMENT,
    ODD_DOCUMENTS,
    SNIPPET_SLOTS,
    VALID_TEXT,
    YAML_SNIPPETS,
    fill_template,
    mutated_specs,
    spec_bytes,
    structured_specs,
    tagged_specs,
)

# Reproducible in CI: a fixed example sequence, no example database, no deadline (the
# machine is shared; a slow example is not a failure).
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The loader's own fallback for an exception nobody foresaw (see load_spec_text).
UNFORESEEN = "cannot be loaded:"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def check(loaded: SpecFile, label: str) -> None:
    """What every load must give: a job or SpecErrors naming the file, nothing unforeseen."""
    assert isinstance(loaded, SpecFile)
    if loaded.job is not None:
        assert loaded.errors == ()
        assert len(spec_fingerprint(loaded.job)) > 0
        return
    assert loaded.errors, "an invalid file must say why"
    for error in loaded.errors:
        assert isinstance(error, SpecError)
        assert error.file == label
        assert isinstance(error.field, str) and isinstance(error.message, str)
        assert error.message, error
        assert not error.message.startswith(UNFORESEEN), str(error)
        # Messages go to logs and SQLite as UTF-8: a lone surrogate would break both.
        str(error).encode("utf-8")
    index = index_specs([loaded])
    assert loaded.name is None or loaded.name in index.invalid or loaded.name in index.jobs


@settings(FUZZ, max_examples=300)
@given(text=structured_specs())
def test_structured_documents_give_spec_errors(text: str) -> None:
    check(load_spec_text(text, "jobs/fuzz.yaml"), "jobs/fuzz.yaml")


@settings(FUZZ, max_examples=300)
@given(text=tagged_specs())
def test_tags_aliases_and_odd_documents_give_spec_errors(text: str) -> None:
    check(load_spec_text(text, "jobs/fuzz.yaml"), "jobs/fuzz.yaml")


@settings(FUZZ, max_examples=300)
@given(data=st.one_of(mutated_specs(), spec_bytes()))
def test_any_file_bytes_give_spec_errors(scratch: Path, data: bytes) -> None:
    path = scratch / "fuzz.yaml"
    path.write_bytes(data)
    check(load_spec_file(path), str(path))


@pytest.mark.parametrize("snippet", YAML_SNIPPETS)
def test_every_snippet_in_every_slot_is_a_spec_error_or_a_job(snippet: str) -> None:
    """The snippet table exhaustively, so no entry depends on what hypothesis picks."""
    for slot in SNIPPET_SLOTS:
        check(load_spec_text(fill_template(slot, snippet), "f.yaml"), "f.yaml")


@pytest.mark.parametrize("index", range(len(ODD_DOCUMENTS)))
def test_every_odd_document_is_refused(index: int) -> None:
    loaded = load_spec_text(ODD_DOCUMENTS[index], "f.yaml")
    check(loaded, "f.yaml")
    assert loaded.job is None


def test_a_duplicate_top_level_key_is_refused() -> None:
    """YAML requires unique keys; a second `metadata:` once silently renamed the job."""
    loaded = load_spec_text(DUPLICATE_KEY_DOCUMENT, "f.yaml")
    assert loaded.job is None, f"loaded as job {loaded.name!r}"
    assert "given twice" in loaded.errors[0].message and "line" in loaded.errors[0].message


def test_the_alias_bomb_is_refused_without_expanding_it() -> None:
    bomb = next(text for text in ODD_DOCUMENTS if "spec: *i" in text)
    loaded = load_spec_text(bomb, "f.yaml")
    assert loaded.job is None
    assert loaded.errors[0].field == FILE_FIELD, loaded.errors


def test_the_valid_base_loads() -> None:
    """The fuzzers start from a valid spec: if it stopped loading they would test less."""
    loaded = load_spec_text(VALID_TEXT, "f.yaml")
    assert loaded.job is not None, loaded.errors
    assert os.fspath(loaded.path) == "f.yaml"
