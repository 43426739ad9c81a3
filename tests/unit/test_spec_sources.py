"""specs.sources: the jobs of what a user hands `validate` and `apply` (files, directories,
stdin, several documents, a saved List), each checked like a spec file."""

from __future__ import annotations

import io
import os
from pathlib import Path

import yaml

from herd_operator.specs.sources import read_sources
from tests.unit.test_cli import spec_yaml


def test_a_file_of_one_job_keeps_its_own_text(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    text = "# the team's job\n" + spec_yaml("alpha")
    path.write_text(text)
    (document,) = read_sources([str(path)], io.StringIO())
    assert document.spec_file.name == "alpha" and document.spec_file.valid
    assert (document.source, document.text) == (str(path), text)


def test_several_documents_are_several_jobs_each_named_by_its_place(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(spec_yaml("alpha") + "---\n" + spec_yaml("beta", low=0))
    first, second = read_sources([str(path)], io.StringIO())
    assert (first.spec_file.name, first.spec_file.valid) == ("alpha", True)
    assert yaml.safe_load(first.text)["metadata"] == {"name": "alpha"}
    assert [str(error) for error in second.spec_file.errors] == [
        f"{path} (document 2): spec.gpus.min: must be at least 1, got integer 0"
    ]


def test_a_saved_list_is_its_items_without_what_the_operator_set(tmp_path: Path) -> None:
    items = []
    for name in ("alpha", "beta"):
        item = yaml.safe_load(spec_yaml(name))
        item["metadata"].update(uid="0123", generation=3, creationTimestamp="2026-12-01T00:00:00Z")
        item["status"] = {"summary": "Running", "epoch": 4}
        items.append(item)
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))

    documents = read_sources([str(path)], io.StringIO())

    assert [d.spec_file.name for d in documents] == ["alpha", "beta"]
    assert all(d.spec_file.valid for d in documents)
    assert str(documents[1].spec_file.path) == f"{path} (items[1])"
    written = yaml.safe_load(documents[0].text)
    assert "status" not in written and written["metadata"] == {"name": "alpha"}


def test_one_saved_job_with_its_status_is_written_without_it(tmp_path: Path) -> None:
    item = yaml.safe_load(spec_yaml("alpha"))
    item["metadata"]["uid"] = "0123"
    item["status"] = {"summary": "Running"}
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(item))
    (document,) = read_sources([str(path)], io.StringIO())
    assert document.spec_file.valid
    assert yaml.safe_load(document.text) == yaml.safe_load(spec_yaml("alpha"))


def test_a_bad_item_of_a_list_names_the_file_the_item_and_the_field(tmp_path: Path) -> None:
    bad = yaml.safe_load(spec_yaml("beta", low=5, high=2))
    path = tmp_path / "saved.yaml"
    path.write_text(
        yaml.safe_dump({"kind": "List", "items": [yaml.safe_load(spec_yaml("alpha")), bad]})
    )
    good, wrong = read_sources([str(path)], io.StringIO())
    assert good.spec_file.valid and not wrong.spec_file.valid
    assert [str(error) for error in wrong.spec_file.errors] == [
        f"{path} (items[1]): spec.gpus: min (5) must not exceed max (2)"
    ]


def test_a_list_without_items_is_not_a_job(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("kind: List\nitems: 3\n")
    (document,) = read_sources([str(path)], io.StringIO())
    assert not document.spec_file.valid
    assert any(error.field == "kind" for error in document.spec_file.errors)


def test_a_directory_is_its_spec_files_by_name_and_stdin_is_dash(tmp_path: Path) -> None:
    (tmp_path / "b.yml").write_text(spec_yaml("beta"))
    (tmp_path / "a.yaml").write_text(spec_yaml("alpha"))
    (tmp_path / ".a.yaml.swp").write_text("not yaml: [")
    (tmp_path / "notes.txt").write_text("not a spec")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text(spec_yaml("gamma"))

    documents = read_sources([str(tmp_path), "-"], io.StringIO(spec_yaml("delta")))

    assert [d.spec_file.name for d in documents] == ["alpha", "beta", "delta"]
    assert [d.source for d in documents] == [str(tmp_path / "a.yaml"), str(tmp_path / "b.yml"), "-"]


def test_what_cannot_be_read_is_one_failed_document(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [HerdJob\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"kind: caf\xe9\n")
    documents = read_sources([str(missing), str(broken), str(latin)], io.StringIO())
    messages = [str(error) for d in documents for error in d.spec_file.errors]
    assert messages[0] == f"{missing}: (file): cannot read file: No such file or directory"
    assert messages[1].startswith(f"{broken}: (file): YAML syntax error at line 2")
    assert messages[2] == f"{latin}: (file): not valid UTF-8 (byte 0xe9 at offset 9)"


def test_a_pipe_is_read(tmp_path: Path) -> None:
    """`apply -f <(generate)`: the shell hands a pipe's path."""
    read_end, write_end = os.pipe()
    os.write(write_end, spec_yaml("alpha").encode())
    os.close(write_end)
    try:
        (document,) = read_sources([f"/dev/fd/{read_end}"], io.StringIO())
    finally:
        os.close(read_end)
    assert document.spec_file.name == "alpha" and document.spec_file.valid
