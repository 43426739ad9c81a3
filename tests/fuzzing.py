"""Hypothesis strategies for bad and odd HerdJob spec files, shared by the spec fuzzers.

Three families, all built around one small valid spec:

- structured: the valid document with a few fields replaced by odd values (wrong
  types, huge or negative numbers, floats, bools, NUL bytes, long strings, nesting,
  unknown fields), dumped by PyYAML;
- tagged: the valid YAML text with one value replaced by a raw YAML snippet (tags such
  as ``!!python/object``, ``!!timestamp``, anchors and aliases, deep flow nesting), or a
  whole odd document (alias bombs, several documents, a BOM);
- mutated: the valid file's bytes with a few random byte-level edits.

Every command a generated spec names is harmless (``true``), and callers that hand files
to a live operator still check that a file is invalid before writing it.

And entries that are not spec files at all (links that loop or lead out, FIFOs, sockets,
directories, files of another user: `HOSTILE_ENTRIES`), for the spec directory's fuzzers.
"""

from __future__ import annotations

import copy
import ctypes
import glob
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

VALID_DOCUMENT: dict[str, Any] = {
    "apiVersion": "herd/v1alpha1",
    "kind": "HerdJob",
    "metadata": {"name": "fuzzed", "labels": {"team": "fuzz"}},
    "spec": {
        "command": ["true"],
        "env": {"OMP_NUM_THREADS": "1"},
        "gpus": {"min": 1, "max": 2},
        "priority": 0,
        "policy": {"name": "static", "params": {}},
        "engine": {"kind": "horovod", "options": {"elasticTimeoutSeconds": 60}},
        "restartPolicy": {"onFailure": False, "backoffLimit": 1},
    },
}
VALID_TEXT = yaml.safe_dump(VALID_DOCUMENT, sort_keys=False)

# Every place in the valid document a fuzzer may overwrite (or add an unknown key under).
FIELD_PATHS: tuple[tuple[str | int, ...], ...] = (
    (),
    ("apiVersion",),
    ("kind",),
    ("metadata",),
    ("metadata", "name"),
    ("metadata", "labels"),
    ("metadata", "labels", "team"),
    ("spec",),
    ("spec", "command"),
    ("spec", "command", 0),
    ("spec", "env"),
    ("spec", "env", "OMP_NUM_THREADS"),
    ("spec", "gpus"),
    ("spec", "gpus", "min"),
    ("spec", "gpus", "max"),
    ("spec", "priority"),
    ("spec", "policy"),
    ("spec", "policy", "name"),
    ("spec", "policy", "params"),
    ("spec", "engine"),
    ("spec", "engine", "kind"),
    ("spec", "engine", "options"),
    ("spec", "engine", "options", "elasticTimeoutSeconds"),
    ("spec", "restartPolicy"),
    ("spec", "restartPolicy", "onFailure"),
    ("spec", "restartPolicy", "backoffLimit"),
)

_NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 2**31, 2**63, -(2**63) - 1, 10**30, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1.0, -0.0, 1e308, float("inf"), float("nan")]),
)
_ODD_CHARACTERS = "\x00\x07\t\r\n\u200b\u202e\ufeff\U0001f600é-_./ "
_ODD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(
        alphabet=st.sampled_from("\x00\x07\t\r\n\u200b\u202e\ufeff\U0001f600é-_./ "), max_size=30
    ),
    st.builds(lambda char, count: char * count, st.characters(), st.integers(200, 20_000)),
    st.sampled_from(["", " ", "~", "null", "yes", "no", "on", "0x1F", "1e3", "../../etc/passwd"]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, _ODD_TEXT)
_KEYS = st.one_of(st.text(max_size=12), st.integers(-5, 5), st.booleans(), st.none())
ODD_VALUES: st.SearchStrategy[Any] = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=4),
    ),
    max_leaves=12,
)


def _has(parent: Any, step: str | int) -> bool:
    if isinstance(parent, dict):
        return step in parent
    return isinstance(parent, list) and isinstance(step, int) and step < len(parent)


def _set_path(document: Any, path: Sequence[str | int], value: Any) -> Any:
    """``document`` with the value at ``path`` replaced (or added); returns the new root."""
    if not path:
        return value
    parent = document
    for step in path[:-1]:
        if not _has(parent, step):
            return document  # an earlier edit removed this branch
        parent = parent[step]
    last = path[-1]
    if isinstance(parent, dict) or _has(parent, last):
        parent[last] = value
    return document


def _delete_path(document: Any, path: Sequence[str | int]) -> Any:
    parent = document
    for step in path[:-1]:
        if isinstance(parent, dict) and step in parent:
            parent = parent[step]
        else:
            return document
    if isinstance(parent, dict) and path:
        parent.pop(path[-1], None)
    return document


@st.composite
def structured_specs(draw: st.DrawFn) -> str:
    """The valid document with 1-3 fields overwritten, added or removed, as YAML text."""
    document: Any = copy.deepcopy(VALID_DOCUMENT)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(FIELD_PATHS))
        action = draw(st.sampled_from(["replace", "unknown", "delete"]))
        if action == "replace":
            document = _set_path(document, path, draw(ODD_VALUES))
        elif action == "unknown":
            key = draw(st.one_of(st.text(min_size=1, max_size=20), st.sampled_from(["x", "Min"])))
            document = _set_path(document, (*path, key), draw(ODD_VALUES))
        else:
            document = _delete_path(document, path)
    return yaml.safe_dump(
        document,
        sort_keys=False,
        allow_unicode=draw(st.booleans()),
        default_flow_style=draw(st.sampled_from([False, True, None])),
    )


# Raw YAML values (one line, flow style) that safe_dump cannot write.
YAML_SNIPPETS: tuple[str, ...] = (
    "!!python/object/apply:builtins.print ['fuzz']",
    "!!python/object:builtins.dict {}",
    "!!python/name:builtins.print",
    "!!python/tuple [1, 2]",
    "!!timestamp 2024-02-30",
    "2024-02-30",
    "2024-02-29T25:61:00Z",
    "!!timestamp nonsense",
    "!!binary AAAA",
    "!!binary '%%%'",
    "!!int abc",
    "!!int 0x",
    "!!int 0b102",
    "!!float x",
    "!!bool maybe",
    "!!null x",
    "!!set {a, b}",
    "!!omap [a: 1, b: 2]",
    "!!pairs [a: 1]",
    "!!str",
    "!!map [1, 2]",
    "!!seq {a: 1}",
    "!custom 3",
    "!<tag:yaml.org,2002:int> 3",
    "!<tag:example.com,2000:x> 3",
    "&loop [*loop]",
    "&loop {a: *loop}",
    "*undefined",
    "&anchor 1",
    "{<<: {min: 1, max: 2}}",
    "{<<: 5}",
    "{<<: [1, 2]}",
    "1e400",
    "-.inf",
    ".nan",
    "0o777",
    "0b101",
    "1_000",
    "0x_",
    "190:20:30",
    "9" * 5000,
    "-" + "9" * 5000,
    "'\\0'",
    '"\\0\\x00\\uffff"',
    '"\\ud800"',
    '"\\udfff\\ud800x"',
    '"\\U0010ffff"',
    '"\\x"',
    "[" * 3000 + "]" * 3000,
    "{a: " * 300 + "1" + "}" * 300,
    "[" * 40 + "1" + "]" * 40,
    "{[a, b]: c}",
    "{{a: 1}: c}",
    "{? [a]: 1}",
    "{a: 1, a: 2}",
    "[a, b",
    "{a: 1",
    "'unclosed",
    "@reserved",
    "`reserved",
    "%directive",
    "- in flow",
    "|\n  literal",
    "a: b: c",
    "\t1",
)
SNIPPET_SLOTS: tuple[str, ...] = (
    "name",
    "labels",
    "command",
    "argument",
    "min",
    "max",
    "priority",
    "env",
    "policy",
    "params",
    "options",
    "restart",
    "unknown",
    "key",
)
_TEMPLATE = """\
apiVersion: herd/v1alpha1
kind: HerdJob
metadata:
  name: {name}
  labels: {labels}
spec:
  command: {command}
  gpus:
    min: {min}
    max: {max}
  priority: {priority}
  env: {env}
  policy: {{name: static, params: {params}}}
  engine: {{kind: horovod, options: {options}}}
  restartPolicy: {restart}
  {key}: {unknown}
"""
_SLOT_DEFAULTS = {
    "name": "fuzzed",
    "labels": "{team: fuzz}",
    "command": "[true, {argument}]",
    "min": "1",
    "max": "2",
    "priority": "0",
    "env": "{OMP_NUM_THREADS: '1'}",
    "params": "{}",
    "options": "{elasticTimeoutSeconds: 60}",
    "restart": "{onFailure: false}",
    "key": "x-note",
    "unknown": "1",
}

# Whole documents that are odd as a whole.
ODD_DOCUMENTS: tuple[str, ...] = (
    "",
    "\n\n# only a comment\n",
    "---\n...\n",
    "~\n",
    "[]\n",
    "just a string\n",
    "42\n",
    VALID_TEXT + "---\n" + VALID_TEXT,
    "\ufeff\ufeff" + VALID_TEXT,
    VALID_TEXT.replace("  ", "\t"),
    "--- !!python/object:builtins.object {}\n",
    "%YAML 1.1\n%YAML 1.1\n---\na: 1\n",
    "%TAG ! tag:example.com,2000:\n--- !x {}\n",
    # An alias bomb: nine levels of ten aliases each, 10^9 values if expanded.
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{chr(98 + level)}: &{chr(98 + level)} [{', '.join([f'*{chr(97 + level)}'] * 10)}]\n"
        for level in range(8)
    )
    + "spec: *i\n",
    "metadata: &m {name: loop, self: *m}\n",
    "metadata: &m {name: loop}\nspec: {gpus: *m, command: [*m]}\n",
    "? [complex, key]\n: value\n",
    "? {a: 1}\n: value\n",
    "metadata:\n  name: dup\nmetadata:\n  name: dup2\n",
)
# A valid spec followed by a second `metadata:` key: PyYAML keeps the last of duplicate
# keys without a word, so this loads as the job `again` (see test_spec_fuzz).
DUPLICATE_KEY_DOCUMENT = VALID_TEXT + "metadata: {name: again}\n"


def fill_template(slot: str, snippet: str) -> str:
    """The valid spec's text with the value in ``slot`` (one of SNIPPET_SLOTS) replaced."""
    values = dict(_SLOT_DEFAULTS)
    if slot == "argument":
        values["command"] = "[true, " + snippet + "]"
    else:
        values[slot] = snippet
    values["command"] = values["command"].replace("{argument}", "x")
    return _TEMPLATE.format(**values)


@st.composite
def tagged_specs(draw: st.DrawFn) -> str:
    """The valid template with one slot holding a raw YAML snippet, or an odd document."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.sampled_from(ODD_DOCUMENTS))
    return fill_template(draw(st.sampled_from(SNIPPET_SLOTS)), draw(st.sampled_from(YAML_SNIPPETS)))


@st.composite
def mutated_specs(draw: st.DrawFn, base: bytes = VALID_TEXT.encode()) -> bytes:
    """``base`` with 1-8 byte-level edits: flips, inserts, deletions, copies, truncation."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 8))):
        action = draw(st.sampled_from(["flip", "insert", "delete", "copy", "truncate", "set"]))
        position = draw(st.integers(0, max(0, len(data) - 1)))
        if action == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and data:
            data[position] = draw(st.sampled_from([0, 0x80, 0xFF, 0xC3, 0x0A, 0x3A, 0x22, 0x5B]))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        elif action == "delete":
            del data[position : position + draw(st.integers(1, 32))]
        elif action == "copy":
            end = position + draw(st.integers(1, 64))
            data[position:position] = data[position:end]
        elif action == "truncate":
            del data[position:]
    return bytes(data)


def spec_bytes() -> st.SearchStrategy[bytes]:
    """Any of the three families, as the bytes of a file."""
    return st.one_of(
        structured_specs().map(str.encode),
        tagged_specs().map(lambda text: text.encode("utf-8", "surrogatepass")),
        mutated_specs(),
    )


# ---- Hostile entries in a spec directory (issue 27) ----
#
# What a writer of the directory (or another local user, where it is shared) can put there
# besides a file: links that loop or lead out, FIFOs, sockets, directories named like specs,
# files of another user. Each is made under a staged name and moved over its place as
# `mv -T` would, so it can replace a running job's file in one step.

OTHER_UID = 65534
"""`nobody`: the owner of a file another local user dropped (chown needs root)."""
INTRUDER = "intruder"
"""The job each hostile entry's readable content declares: it must never appear."""
INTRUDER_TEXT = (
    "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
    f"metadata: {{name: {INTRUDER}}}\nspec: {{command: ['true'], gpus: {{min: 1, max: 1}}}}\n"
)
LINKS_TOO_MANY = 45
"""A chain of more links than Linux follows in one path (40)."""


def _partner(path: Path, what: str) -> Path:
    """A helper entry beside `path`, hidden (a dotfile is never read as a spec)."""
    return path.with_name(f".{path.name}.hostile-{what}")


def _fifo(staged: Path, final: Path, outside: Path) -> None:
    os.mkfifo(staged)


def _socket(staged: Path, final: Path, outside: Path) -> None:
    os.mknod(staged, stat.S_IFSOCK | 0o600)  # no bind: its path may be over 108 bytes


def _directory(staged: Path, final: Path, outside: Path) -> None:
    staged.mkdir()
    (staged / "inside.yaml").write_text(INTRUDER_TEXT)


def _link_out(staged: Path, final: Path, outside: Path) -> None:
    staged.symlink_to(outside)


def _link_to_directory(staged: Path, final: Path, outside: Path) -> None:
    _partner(final, "dir").mkdir(exist_ok=True)
    staged.symlink_to(_partner(final, "dir").name)


def _dangling_link(staged: Path, final: Path, outside: Path) -> None:
    staged.symlink_to(_partner(final, "nothing").name)


def _self_loop(staged: Path, final: Path, outside: Path) -> None:
    staged.symlink_to(final.name)  # itself, once moved into place


def _loop_of_two(staged: Path, final: Path, outside: Path) -> None:
    partner = _partner(final, "loop")
    partner.unlink(missing_ok=True)
    partner.symlink_to(final.name)
    staged.symlink_to(partner.name)


def _chain_too_long(staged: Path, final: Path, outside: Path) -> None:
    target = _partner(final, "target")
    target.write_text(INTRUDER_TEXT)
    previous = target.name
    for number in range(1, LINKS_TOO_MANY):
        link = _partner(final, f"c{number}")
        link.unlink(missing_ok=True)
        link.symlink_to(previous)
        previous = link.name
    staged.symlink_to(previous)


def _file_of_another_user(staged: Path, final: Path, outside: Path) -> None:
    staged.write_text(INTRUDER_TEXT)
    os.chown(staged, OTHER_UID, OTHER_UID)


HOSTILE_ENTRIES: dict[str, tuple[Callable[[Path, Path, Path], None], str]] = {
    "fifo": (_fifo, "not a regular file (a FIFO)"),
    "socket": (_socket, "not a regular file (a socket)"),
    "directory": (_directory, "not a regular file (a directory)"),
    "link-to-directory": (_link_to_directory, "not a regular file (a directory)"),
    "link-out": (_link_out, "outside the spec directory"),
    "dangling-link": (_dangling_link, "a dangling link"),
    "self-loop": (_self_loop, "a symlink loop"),
    "loop-of-two": (_loop_of_two, "a symlink loop"),
    "chain-too-long": (_chain_too_long, "a symlink loop, or a chain of links too long"),
    "other-user": (_file_of_another_user, f"owned by uid {OTHER_UID}"),
}
"""Each kind: how to make it (staged path, final path, a file outside the directory) and
what the operator's reason for skipping it says."""


def chown_refused() -> str | None:
    """Why a file of another user cannot be made here (None: it can)."""
    with tempfile.NamedTemporaryFile() as probe:
        try:
            os.chown(probe.name, OTHER_UID, OTHER_UID)
        except PermissionError:
            return "making a file of another user (uid 65534) needs root or CAP_CHOWN"
    return None


def put_hostile(path: Path, kind: str, outside: Path) -> None:
    """Make a hostile entry of `kind` at `path`, in one step over whatever is there."""
    make, _ = HOSTILE_ENTRIES[kind]
    staged = path.with_name(f".{path.name}.staged")
    remove_entry(staged)
    make(staged, path, outside)
    move_over(staged, path)


def put_file(path: Path, text: str) -> None:
    """A regular file at `path` in one step, over whatever is there (a directory too)."""
    staged = path.with_name(f".{path.name}.staged")
    remove_entry(staged)
    staged.write_text(text)
    move_over(staged, path)


def move_over(staged: Path, path: Path) -> None:
    """`staged` to `path` in one step, as `mv -T` (a rename); a directory and a file trade
    places (`mv --exchange`, renameat2's RENAME_EXCHANGE), since neither can be renamed
    over the other, and a moment without the entry would be a real deletion."""
    if not os.path.lexists(path) or not (_is_real_directory(path) or _is_real_directory(staged)):
        os.replace(staged, path)
        return
    exchange(staged, path)
    remove_entry(staged)


def exchange(first: Path, second: Path) -> None:
    """Swap two entries atomically (Linux renameat2 with RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_cwd, rename_exchange = -100, 2
    if libc.renameat2(at_cwd, bytes(first), at_cwd, bytes(second), rename_exchange) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), str(first), None, str(second))


def _is_real_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def remove_entry(path: Path) -> None:
    """Remove whatever `path` is (a file, a link, a FIFO, a directory), if anything."""
    if _is_real_directory(path):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_partners(path: Path) -> None:
    """Remove the hidden helper entries `put_hostile` made beside `path`."""
    for partner in path.parent.glob(f".{glob.escape(path.name)}.hostile-*"):
        remove_entry(partner)
