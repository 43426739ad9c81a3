"""The spec directory as the writing commands (`apply`, `delete`, `suspend`, `resume`) see
it: where it is, which file declares which job, an atomic write of one spec file, and the
edit of `spec.suspend` that keeps the rest of a file as its author wrote it.

Apart from the commands: the operator's relist reads whatever these leave, at any moment,
so every write here is whole (a temporary file in the same directory, flushed to disk,
then renamed over the old one) and a temporary file is never a spec file (a dotfile,
which the spec directory skips).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from herd_operator.specs import HerdJob, SpecFile, load_spec_text, scan_spec_dir

SPECS_DIR_ENV = "HERD_SPECS_DIR"
"""The spec directory of the writing commands when --specs-dir is not given (and of `run`)."""
DEFAULT_SPECS_DIR = Path("jobs")


def specs_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--specs-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the spec directory the operator watches (`run --specs-dir`; default: "
        f"${SPECS_DIR_ENV}, else ./{DEFAULT_SPECS_DIR})",
    )


def default_specs_dir() -> Path:
    return Path(os.environ.get(SPECS_DIR_ENV) or DEFAULT_SPECS_DIR)


class SpecsDirError(Exception):
    """The spec directory cannot be used; the message says why and what to do."""


def specs_dir(given: Path | None) -> Path:
    """The spec directory to write in: `given`, else $HERD_SPECS_DIR, else ./jobs; it must
    exist (the operator's, not a new one nobody watches)."""
    directory = given or default_specs_dir()
    if not directory.is_dir():
        raise SpecsDirError(
            f"the spec directory {directory} does not exist or is not a directory (pass the"
            f" --specs-dir the operator runs with, or set ${SPECS_DIR_ENV})"
        )
    return directory


@dataclass(frozen=True)
class Declared:
    """What the spec directory holds now, by the job name each file declares (a file
    that is invalid still declares the name it spells)."""

    files: dict[str, list[SpecFile]]
    paths: set[Path]
    """Every spec file of the directory, named or not."""

    @classmethod
    def scan(cls, directory: Path) -> Declared:
        files: dict[str, list[SpecFile]] = {}
        scanned = scan_spec_dir(directory)
        for spec_file in scanned:
            if spec_file.name is not None:
                files.setdefault(spec_file.name, []).append(spec_file)
        return cls(files, {spec_file.path for spec_file in scanned})

    def one_file(self, name: str) -> SpecFile | None:
        """The file that declares `name`; None when none does. Raises `SpecsDirError`
        when several do (the operator runs neither: the user chooses)."""
        declaring = self.files.get(name, [])
        if len(declaring) > 1:
            paths = ", ".join(str(spec_file.path) for spec_file in declaring)
            raise SpecsDirError(f"job {name!r} is declared by several files: {paths}")
        return declaring[0] if declaring else None


def not_found(name: str) -> str:
    """kubectl's words for a name that no spec declares."""
    return f'Error from server (NotFound): herdjobs "{name}" not found'


def same_job(first: HerdJob, second: HerdJob) -> bool:
    """Whether two specs declare the same job: every field, labels included."""
    return first.model_dump(mode="json") == second.model_dump(mode="json")


def write_spec_file(
    path: Path, text: str, *, before_rename: Callable[[Path], None] | None = None
) -> None:
    """Replace `path` with `text`, atomically: readers see the old file or the new one,
    never a part, and a crash leaves the old file (and at most a dotfile, which is no spec).

    A new file gets the mode a new file gets (0666 less the umask); a replaced one keeps
    its mode, and its group where this user may keep it. `before_rename` is called with the
    temporary file once it is on disk (tests crash there)."""
    directory = path.parent
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, _mode_for(path))
        _keep_group(path, Path(temporary))
        if before_rename is not None:
            before_rename(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(directory)


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _keep_group(old: Path, new: Path) -> None:
    try:
        group = old.stat().st_gid
    except FileNotFoundError:
        return
    with contextlib.suppress(OSError):  # not this user's group: the file gets its default
        os.chown(new, -1, group)


def _sync_directory(directory: Path) -> None:
    """The rename itself survives a crash once the directory is synced."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError:  # some file systems do not sync directories; the rename still stands
        pass
    finally:
        os.close(descriptor)


def with_suspend(text: str, job: HerdJob, suspend: bool, file: str) -> str:
    """The spec file `text` (which declares `job`) with `spec.suspend` set to `suspend`.

    The value is edited in place, or the line added as the first of `spec`, so comments and
    layout stay; the result is loaded again and must be the same job but for `suspend`.
    When it is not (a layout this edit does not know), the file is written anew from its
    data, without its comments."""
    wanted = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": suspend})})
    edited = _edited(text, suspend)
    if edited is not None:
        loaded = load_spec_text(edited, file)
        if loaded.job is not None and same_job(loaded.job, wanted):
            return edited
    data: Any = yaml.safe_load(text)
    data["spec"]["suspend"] = suspend
    return yaml.safe_dump(data, sort_keys=False)


def _edited(text: str, suspend: bool) -> str | None:
    """`text` with the `suspend` key of its block `spec` mapping set; None when it has no
    such mapping."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    spec = _value_of(root, "spec")
    if not isinstance(spec, yaml.MappingNode) or spec.flow_style or not spec.value:
        return None
    word = "true" if suspend else "false"
    current = _value_of(spec, "suspend")
    if current is not None:
        if not isinstance(current, yaml.ScalarNode):
            return None
        start, end = current.start_mark.index, current.end_mark.index
        return f"{text[:start]}{word}{text[end:]}"
    first_key = spec.value[0][0]
    column = first_key.start_mark.column
    line_start = first_key.start_mark.index - column
    if text[line_start : first_key.start_mark.index].strip():
        return None  # the first key does not begin its line
    return f"{text[:line_start]}{' ' * column}suspend: {word}\n{text[line_start:]}"


def _value_of(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            found: yaml.Node = value_node
            return found
    return None
