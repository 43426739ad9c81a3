"""Specs as a user hands them to `validate` and `apply`: files, directories, standard input
(`-`), several YAML documents in one source, and a `List` saved from `get -o yaml`.

Apart from `loading`, which reads the operator's spec directory the way the operator takes
it (one HerdJob per file): here one source may hold many jobs, and each of them is checked
by the same `load_spec_document`, so `validate` and `apply` say the same of every job.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from herd_operator.specs.loading import (
    FILE_FIELD,
    MAX_SPEC_BYTES,
    SpecError,
    SpecFile,
    is_spec_filename,
    load_documents,
    load_spec_document,
)
from herd_operator.specs.models import READ_ONLY_METADATA

STDIN = "-"
"""The source that stands for standard input."""
LIST_KIND = "List"
"""What `get -o yaml|json` prints for several jobs: `{apiVersion: v1, kind: List, items}`."""
MAX_SOURCE_BYTES = 64 * MAX_SPEC_BYTES
"""One source may hold many jobs (a saved List): 64 times one spec file's limit. The YAML
loader's bound on values per document (100,000: some 3,000 jobs in one List) still holds."""


@dataclass(frozen=True)
class SourceDocument:
    """One job read from a source: the outcome of loading it, and what to write for it."""

    spec_file: SpecFile
    """The job, or why it is not one. Its path (which labels its errors) is the source's,
    followed by `(document N)` or `(items[N])` when the source holds more than one."""
    source: str
    """The file it came from, or `-`."""
    text: str
    """The YAML a spec file for it holds: the source's own text when the job is all the
    source holds and it carries nothing the operator sets (comments and layout stay),
    else the document without `status` and the read-only `metadata` fields."""


def read_sources(sources: Sequence[str], stdin: IO[str]) -> list[SourceDocument]:
    """Every job of `sources`, in order: a file, a directory (its `*.yaml`/`*.yml` files,
    not recursively, by name) or `-` (read once from `stdin`). A source that cannot be read
    or parsed is one failed document, named by its path."""
    documents: list[SourceDocument] = []
    for source in sources:
        if source == STDIN:
            documents += _documents(stdin.read(), STDIN)
            continue
        path = Path(source)
        if path.is_dir():
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries if is_spec_filename(e.name) and e.is_file())
            for name in names:
                documents += _file_documents(path / name)
        else:
            documents += _file_documents(path)
    return documents


def _file_documents(path: Path) -> list[SourceDocument]:
    text = _read_text(path)
    if isinstance(text, SpecError):
        return [_failed(str(path), text)]
    return _documents(text, str(path))


def _read_text(path: Path) -> str | SpecError:
    """The file's text, bounded. A pipe is read too (`apply -f <(generate)`), a directory
    or a device is not."""
    try:
        with path.open("rb") as stream:
            mode = os.fstat(stream.fileno()).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                return SpecError(str(path), FILE_FIELD, "not a regular file or a pipe; not read")
            data = stream.read(MAX_SOURCE_BYTES + 1)
    except OSError as exc:
        return SpecError(str(path), FILE_FIELD, f"cannot read file: {exc.strerror or exc}")
    if len(data) > MAX_SOURCE_BYTES:
        return SpecError(str(path), FILE_FIELD, f"over the limit of {MAX_SOURCE_BYTES} bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return SpecError(
            str(path),
            FILE_FIELD,
            f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})",
        )


def _documents(text: str, source: str) -> list[SourceDocument]:
    loaded = load_documents(text, source)
    if isinstance(loaded, SpecFile):
        return [SourceDocument(loaded, source, text)]
    items = list(_items(loaded, source))
    if len(items) == 1 and len(loaded) == 1 and items[0][1] is loaded[0]:
        label, raw = items[0]
        kept = text if _as_declared(raw) else _without_observed(raw)
        return [SourceDocument(load_spec_document(raw, label), source, kept)]
    return [
        SourceDocument(load_spec_document(raw, label), source, _without_observed(raw))
        for label, raw in items
    ]


def _items(documents: list[Any], source: str) -> Iterator[tuple[str, Any]]:
    """(label, document) of each job: a List's items stand for themselves."""
    several = len(documents) > 1
    for number, document in enumerate(documents, start=1):
        label = f"{source} (document {number})" if several else source
        if isinstance(document, dict) and document.get("kind") == LIST_KIND:
            items = document.get("items")
            if not isinstance(items, list):
                # Not a job: validated as one, it fails with `kind` named as the field.
                yield label, document
                continue
            for index, item in enumerate(items):
                yield f"{label} (items[{index}])", item
        else:
            yield label, document


def _as_declared(raw: object) -> bool:
    """Whether the document holds only what a user declares (no `status`, no identity the
    operator gave it): then its own text is what a spec file holds."""
    if not isinstance(raw, dict):
        return True
    metadata = raw.get("metadata")
    return "status" not in raw and not (
        isinstance(metadata, dict) and READ_ONLY_METADATA & metadata.keys()
    )


def _without_observed(raw: object) -> str:
    """The document as a spec file: what the operator observed or set left out (the loader
    ignores them; a spec file with them would say things no longer true)."""
    if isinstance(raw, dict):
        raw = {key: value for key, value in raw.items() if key != "status"}
        metadata = raw.get("metadata")
        if isinstance(metadata, dict):
            raw["metadata"] = {
                key: value for key, value in metadata.items() if key not in READ_ONLY_METADATA
            }
    try:
        return yaml.safe_dump(raw, sort_keys=False)
    except yaml.YAMLError:  # not plain data: the document is invalid, and never written
        return ""


def _failed(source: str, error: SpecError) -> SourceDocument:
    return SourceDocument(SpecFile(Path(source), None, None, (error,)), source, "")
