"""Reading HerdJob files: every problem becomes a SpecError, never an exception."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from herd_operator.specs.dependencies import (
    DEPENDS_ON_FIELD,
    cycle_message,
    dependency_cycles,
    self_dependency,
)
from herd_operator.specs.models import EngineRef, HerdJob, HorovodOptions

MAX_SPEC_BYTES = 1 << 20
# Bounds on the loaded YAML: aliases can expand a small file into billions of values, and
# deep nesting would exhaust the stack of everything that walks the data afterwards.
MAX_SPEC_VALUES = 100_000
MAX_SPEC_DEPTH = 64

FILE_FIELD = "(file)"

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_EXPECTED_BY_ERROR_TYPE = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


@dataclass(frozen=True)
class SpecError:
    """One problem in one spec file, located by a dotted path in YAML names."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"


@dataclass(frozen=True)
class SpecFile:
    """The outcome of loading one file: a job, or the errors that prevent one."""

    path: Path
    name: str | None
    job: HerdJob | None
    errors: tuple[SpecError, ...]

    def __post_init__(self) -> None:
        if (self.job is None) == (not self.errors):
            raise ValueError("a SpecFile has either a job or errors, not both or neither")

    @property
    def valid(self) -> bool:
        return self.job is not None


@dataclass(frozen=True)
class SpecIndex:
    """A directory's files, keyed by job name."""

    jobs: dict[str, SpecFile]
    invalid: dict[str, tuple[SpecError, ...]]
    unnamed: tuple[SpecError, ...]


def is_spec_filename(name: str) -> bool:
    """Whether a file in the spec directory is a job spec (not a dotfile or editor leftover)."""
    if name.startswith((".", "#")) or name.endswith("~"):
        return False
    lowered = name.lower()
    if lowered.endswith(".swp"):
        return False
    return lowered.endswith((".yaml", ".yml"))


def load_spec_file(path: Path) -> SpecFile:
    """Load and validate one spec file; problems are reported in `errors`."""
    try:
        # Non-blocking: a FIFO swapped in for the file must not hang the reader (opening one
        # for reading blocks until a writer comes). The opened descriptor is what is checked.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return _failed(path, None, f"cannot read file: {exc.strerror or exc}")
    try:
        return load_spec_descriptor(descriptor, path)
    finally:
        os.close(descriptor)


def load_spec_descriptor(descriptor: int, path: Path) -> SpecFile:
    """`load_spec_file` of a file its caller opened and checked (left open), named `path`."""
    try:
        with os.fdopen(descriptor, "rb", closefd=False) as stream:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                return _failed(
                    path, None, f"not a regular file ({file_kind(status.st_mode)}); not read"
                )
            size = status.st_size
            # Ask for the size the file has (+1 to see growth), not the limit: read(n)
            # allocates n bytes first, and 1 MiB per file was 40% of a 10,000-file relist.
            data = stream.read(min(size, MAX_SPEC_BYTES) + 1)
            if len(data) > size:  # it grew since fstat: read on, up to the limit
                data += stream.read(MAX_SPEC_BYTES + 1 - len(data))
            size = max(size, len(data))
    except OSError as exc:
        return _failed(path, None, f"cannot read file: {exc.strerror or exc}")
    if len(data) > MAX_SPEC_BYTES:
        return _failed(
            path, None, f"file is {size} bytes, over the limit of {MAX_SPEC_BYTES} bytes"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return _failed(
            path, None, f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        )
    return load_spec_text(text, str(path))


# libyaml's safe loader when PyYAML was built with it: about 5x faster on a relist of many
# files; same safety (no arbitrary tags).
_BASE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_TOO_MANY_VALUES = (
    f"more than {MAX_SPEC_VALUES} values once YAML aliases and merge keys are expanded"
    " (or an alias refers to itself)"
)


class _ExpansionError(yaml.YAMLError):
    """The document stands for too many values once its aliases and merge keys are expanded."""


class _SafeLoader(_BASE_LOADER):  # type: ignore[valid-type,misc]
    """The safe loader, refusing a key given twice in one mapping (YAML forbids it, and
    PyYAML would silently keep the last: a second `metadata:` would rename the job), and a
    document too large once expanded, before anything of it is built."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Aliases and merge keys (`<<`) let a few hundred bytes stand for billions of values,
        # and PyYAML before 6.0.4 flattened nested merges in exponential time: a 613-byte
        # file kept the relist busy for minutes. Counted on the composed nodes, each once.
        if _expanded_size(node, MAX_SPEC_VALUES) > MAX_SPEC_VALUES:
            raise _ExpansionError(_TOO_MANY_VALUES)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges another mapping, it may be given more than once
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {_clip(str(key))!r} is given twice", key_node.start_mark,
                )  # fmt: skip
        return dict(super().construct_mapping(node, deep=deep))


_SAFE_LOADER: type[yaml.SafeLoader] = _SafeLoader


def load_spec_text(text: str, file: str) -> SpecFile:
    """Validate the YAML text of one spec; `file` labels the errors. Never raises: a file
    that trips an error nobody foresaw is one more invalid spec, not a stopped operator."""
    try:
        return _load_spec_text(text, file)
    except Exception as exc:
        return _failed(
            Path(file), None, f"cannot be loaded: {type(exc).__name__}: {_clip(str(exc))}"
        )


def load_documents(text: str, file: str) -> list[Any] | SpecFile:
    """The YAML documents of `text` (empty ones left out), read as every spec is (safe,
    bounded, no key twice); or, when it is not such YAML, the failed `SpecFile` that says
    why (`file` labels it). `apply` reads several documents, and Lists, with it."""
    path = Path(file)
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=_SAFE_LOADER) if doc is not None]
    except _ExpansionError as exc:
        return _failed(path, None, str(exc))
    except yaml.MarkedYAMLError as exc:
        return _failed(path, None, _yaml_error_message(exc))
    except yaml.YAMLError as exc:
        return _failed(path, None, f"invalid YAML: {exc}")
    except RecursionError:
        return _failed(path, None, "YAML is nested too deeply")
    except (ValueError, KeyError, AttributeError, TypeError, OverflowError, IndexError) as exc:
        # PyYAML's constructors raise these for values its grammar accepts but cannot build:
        # `2024-02-30` (a date that does not exist), `!!int abc`, `!!bool abc`, integers of
        # more digits than Python converts. A bad value is a spec error like any other.
        return _failed(path, None, _unreadable_value_message(text, exc))
    if not documents:
        return _failed(path, None, "file is empty")
    return documents


def _load_spec_text(text: str, file: str) -> SpecFile:
    documents = load_documents(text, file)
    if isinstance(documents, SpecFile):
        return documents
    if len(documents) > 1:
        return _failed(
            Path(file),
            _name_of(documents[0]),
            f"contains {len(documents)} YAML documents; put one HerdJob per file",
        )
    return load_spec_document(documents[0], file)


def load_spec_document(raw: object, file: str) -> SpecFile:
    """Validate one loaded YAML document as a HerdJob; `file` labels the errors. Never
    raises (as `load_spec_text`)."""
    try:
        return _load_spec_document(raw, file)
    except Exception as exc:
        return _failed(
            Path(file), None, f"cannot be loaded: {type(exc).__name__}: {_clip(str(exc))}"
        )


def _load_spec_document(raw: object, file: str) -> SpecFile:
    path = Path(file)
    name = _name_of(raw)
    if not isinstance(raw, dict):
        return _failed(path, None, f"top level must be a mapping (a HerdJob), got {_describe(raw)}")
    shape_problem = _shape_problem(raw)
    if shape_problem is not None:
        return _failed(path, name, shape_problem)
    try:
        job = HerdJob.model_validate(raw)
    except ValidationError as exc:
        errors = [
            SpecError(file, _format_location(error["loc"]), error_message(error))
            for error in exc.errors(include_url=False)
        ]
        return SpecFile(path=path, name=name, job=None, errors=_sorted(errors))
    problem = self_dependency(job.name, job.spec.depends_on)
    if problem is not None:
        return _failed_field(path, job.name, DEPENDS_ON_FIELD, problem)
    return SpecFile(path=path, name=job.name, job=job, errors=())


def scan_spec_dir(directory: Path) -> list[SpecFile]:
    """Load every spec file directly in `directory`, sorted by file name."""
    if not directory.exists():
        raise FileNotFoundError(f"spec directory does not exist: {directory}")
    if not directory.is_dir():
        raise NotADirectoryError(f"spec directory is not a directory: {directory}")
    with os.scandir(directory) as entries:
        named = [entry for entry in entries if is_spec_filename(entry.name)]
    # os.path.isfile, not DirEntry.is_file: that raises on a link that loops (ELOOP).
    names = sorted(entry.name for entry in named if os.path.isfile(entry.path))
    spec_files = []
    for name in names:
        spec_file = load_spec_file(directory / name)
        # A file deleted between listing and reading is gone, not broken.
        if spec_file.valid or spec_file.path.exists():
            spec_files.append(spec_file)
    return spec_files


def index_specs(files: Sequence[SpecFile]) -> SpecIndex:
    """Key files by job name; a name declared by several files is an error in all of them."""
    by_name: dict[str, list[SpecFile]] = {}
    unnamed: list[SpecError] = []
    for spec_file in files:
        if spec_file.name is None:
            unnamed.extend(spec_file.errors)
        else:
            by_name.setdefault(spec_file.name, []).append(spec_file)
    jobs: dict[str, SpecFile] = {}
    invalid: dict[str, tuple[SpecError, ...]] = {}
    for name, declaring in by_name.items():
        if len(declaring) == 1:
            if declaring[0].valid:
                jobs[name] = declaring[0]
            else:
                invalid[name] = declaring[0].errors
            continue
        errors: list[SpecError] = []
        for spec_file in declaring:
            others = ", ".join(other.path.name for other in declaring if other is not spec_file)
            errors.append(
                SpecError(
                    str(spec_file.path), "metadata.name", f"{name!r} is also declared in {others}"
                )
            )
            errors.extend(spec_file.errors)
        invalid[name] = _sorted(errors, by_file=True)
    # A dependency cycle makes every job on it invalid: none of them could ever start.
    graph = {
        name: spec_file.job.spec.depends_on
        for name, spec_file in jobs.items()
        if spec_file.job is not None and spec_file.job.spec.depends_on
    }
    for name, cycle in dependency_cycles(graph).items():
        path = str(jobs.pop(name).path)
        invalid[name] = (SpecError(path, DEPENDS_ON_FIELD, cycle_message(cycle)),)
    return SpecIndex(jobs=jobs, invalid=invalid, unnamed=_sorted(unnamed, by_file=True))


def _failed(path: Path, name: str | None, message: str) -> SpecFile:
    return _failed_field(path, name, FILE_FIELD, message)


def _failed_field(path: Path, name: str | None, field: str, message: str) -> SpecFile:
    return SpecFile(path=path, name=name, job=None, errors=(SpecError(str(path), field, message),))


def _sorted(errors: Sequence[SpecError], *, by_file: bool = False) -> tuple[SpecError, ...]:
    if by_file:
        return tuple(sorted(errors, key=lambda e: (e.file, e.field, e.message)))
    return tuple(sorted(errors, key=lambda e: (e.field, e.message)))


MAX_DECLARED_NAME_CHARS = 253
"""The longest metadata.name an invalid file is known by (a DNS-1123 subdomain's bound; a
job's name is a label, at most 63): its errors show on that name (an InvalidSpec event on
`herdjob/NAME`). A longer one names nothing, so no event, log line or key carries a name of
thousands of characters; the file's errors are said under the file's path."""


def _name_of(raw: object) -> str | None:
    """metadata.name as written, even in an otherwise invalid file (if not absurdly long)."""
    if not isinstance(raw, dict):
        return None
    metadata = raw.get("metadata")
    if not isinstance(metadata, dict):
        return None
    name = metadata.get("name")
    return name if isinstance(name, str) and 0 < len(name) <= MAX_DECLARED_NAME_CHARS else None


def _yaml_error_message(exc: yaml.MarkedYAMLError) -> str:
    # A constructor error is well-formed YAML with a tag safe_load refuses (e.g. !!python/...).
    kind = (
        "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
    )
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "invalid YAML"
    message = f"{kind}: {problem}" if mark is None else f"{kind} at {_where(mark)}: {problem}"
    # The context says where the unfinished construct began, often the real mistake.
    if exc.context and exc.context_mark is not None and exc.problem:
        message += f" ({exc.context} at {_where(exc.context_mark)})"
    return message


def _unreadable_value_message(text: str, exc: Exception) -> str:
    """Where the value is that PyYAML parsed but could not build, and why.

    PyYAML's error carries no position, so the scalars are built again one at a time (only
    when loading failed: the usual path pays nothing) to find the first that fails.
    """
    constructor = yaml.constructor.SafeConstructor()
    try:
        documents = [node for node in yaml.compose_all(text, Loader=yaml.SafeLoader) if node]
    except (yaml.YAMLError, RecursionError):
        documents = []
    # Depth first, in document order; each node once: aliases share nodes, and walking
    # every path through them is exponential in a few hundred bytes.
    pending = list(reversed(documents))
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            pending.extend(reversed([item for pair in node.value for item in pair]))
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(reversed(node.value))
        elif isinstance(node, yaml.ScalarNode):
            try:
                constructor.construct_object(node)
            except Exception as err:
                tag = node.tag.rsplit(":", 1)[-1]
                return (
                    f"YAML error at {_where(node.start_mark)}: {_clip(node.value, 40)!r} is not"
                    f" a valid {tag} ({_clip(str(err) or type(err).__name__, 80)})"
                )
    return f"YAML value that cannot be read: {_clip(str(exc) or type(exc).__name__)}"


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _clip(text: str, limit: int = 120) -> str:
    """A library's message, shortened: it may quote the file, and logs repeat it."""
    text = text.replace("\n", " ")
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many values the composed document stands for once every alias and merge key is
    expanded (a mapping counts 1 plus its keys and values), at most `limit + 1`. Each node
    is sized once, so this is linear in the file, whatever the expansion. An alias inside
    what it refers to adds nothing here: the built document is then too deep, which
    `_shape_problem` says."""
    over = limit + 1
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_sized = stack.pop()
        key = id(node)
        if children_sized:
            open_nodes.discard(key)
            total = 1 + sum(sizes.get(id(child), 0) for child in _children(node))
            sizes[key] = min(total, over)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            continue  # a cycle: the alias is inside its own anchor
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _shape_problem(raw: dict[Any, Any]) -> str | None:
    """Say why the loaded data is too big or too deep to validate, or None."""
    count = 0
    pending: list[tuple[object, int]] = [(raw, 1)]
    while pending:
        item, depth = pending.pop()
        count += 1
        if count > MAX_SPEC_VALUES:
            return _TOO_MANY_VALUES
        if depth > MAX_SPEC_DEPTH:
            return (
                f"nested more than {MAX_SPEC_DEPTH} levels deep (or a YAML alias refers to itself)"
            )
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for pair in item.items() for child in pair)
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
    return None


def format_location(location: tuple[int | str, ...]) -> str:
    """A pydantic error's location as a YAML path: `spec.gpus.min`, `spec.command[0]`."""
    return _format_location(location)


def _format_location(location: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for segment in location:
        if segment == "[key]":
            continue  # pydantic marks dict-key errors this way; the key itself is already there
        if isinstance(segment, int):
            parts.append(f"[{segment}]")
        elif _PLAIN_KEY.match(segment):
            parts.append(f".{segment}" if parts else segment)
        else:
            parts.append(f"[{segment!r}]")
    return "".join(parts) or FILE_FIELD


def error_message(error: ErrorDetails, model: type[BaseModel] | None = None) -> str:
    """One pydantic error said as a YAML user would read it. `model` is the model the
    error's location starts from (default: the whole HerdJob), to list allowed fields."""
    kind = error["type"]
    given = error["input"]
    context = error.get("ctx", {})
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(error["loc"][:-1], model or HerdJob)
        return f"unknown field (allowed: {', '.join(allowed)})" if allowed else "unknown field"
    if kind == "literal_error":
        return f"must be {context['expected']}, got {_describe(given)}"
    if kind in _EXPECTED_BY_ERROR_TYPE:
        message = f"expected {_EXPECTED_BY_ERROR_TYPE[kind]}, got {_describe(given)}"
        if kind == "string_type" and isinstance(given, int | float):
            message += " (put it in quotes)"
        return message
    if kind in ("too_short", "string_too_short") and context.get("min_length") == 1:
        return "must not be empty"
    if kind == "greater_than_equal":
        return f"must be at least {_bound(context['ge'])}, got {_describe(given)}"
    if kind == "greater_than":
        return f"must be greater than {_bound(context['gt'])}, got {_describe(given)}"
    if kind == "value_error":
        return str(context["error"])
    return error["msg"]


def _bound(value: object) -> str:
    """A bound as the YAML would say it: 0, not 0.0 (a float field's bound is a float)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _allowed_fields(location: tuple[int | str, ...], model: type[BaseModel]) -> list[str]:
    """YAML names of the fields of the model at `location` under `model`, in order."""
    for segment in location:
        if isinstance(segment, int):
            continue  # an item of a list of models: the same model
        if model is EngineRef and segment == "options":
            # Free-form for other engines; an unknown field there came from horovod's.
            model = HorovodOptions
            continue
        field = next(
            (
                info
                for field_name, info in model.model_fields.items()
                if segment in (field_name, info.alias)
            ),
            None,
        )
        if field is None:
            return []
        # The model itself, or the model of a list of them or of an optional one.
        inner = [
            candidate
            for candidate in (field.annotation, *get_args(field.annotation))
            if isinstance(candidate, type) and issubclass(candidate, BaseModel)
        ]
        if not inner:
            return []
        model = inner[0]
    return [info.alias or field_name for field_name, info in model.model_fields.items()]


def _describe(value: object) -> str:
    """A value as a YAML user would name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{type(value).__name__} {value!r}"
