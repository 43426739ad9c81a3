"""`get --sort-by`: the key jobs are listed by, as kubectl's (`--sort-by=.metadata.name`), or a
column's name (`--sort-by=age`).

A key is a path into the HerdJob object that `get -o json` prints: dot-separated fields,
optionally in kubectl's braces and with list indexes (`{.status.placement[0].host}`); or a
table column's name, case-insensitive, which stands for the field the column shows.
Apart from the reading commands because it is a small language of its own, tested alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

_Item = TypeVar("_Item")

COLUMN_PATHS = {
    "name": ".metadata.name",
    "status": ".status.summary",
    "min": ".spec.gpus.min",
    "max": ".spec.gpus.max",
    "desired": ".status.gpus.desired",
    "allocated": ".status.gpus.allocated",
    "active": ".status.gpus.active",
    # Oldest first, as kubectl's --sort-by=.metadata.creationTimestamp lists them.
    "age": ".metadata.creationTimestamp",
    "epoch": ".status.epoch",
    "restarts": ".status.restarts",
    "priority": ".spec.priority",
    "policy": ".spec.policy.name",
}
"""The table's columns (and two more fields a table user sorts by), by name."""

_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)((?:\[[0-9]+\])*)")
_INDEX = re.compile(r"\[([0-9]+)\]")
SORT_BY_HELP = (
    "a field of the HerdJob object (-o json), as kubectl's: .metadata.name, "
    "'{.status.restarts}', .status.placement[0].host; or a column: "
    + ", ".join(sorted(COLUMN_PATHS))
)


class SortKeyError(ValueError):
    """A --sort-by that does not parse; the message says what is allowed."""


@dataclass(frozen=True)
class SortKey:
    """A parsed --sort-by: the text given and the steps (field names, list indexes) it takes."""

    text: str
    steps: tuple[str | int, ...]

    def value(self, obj: Any) -> tuple[bool, Any]:
        """(found, value) of this key in `obj`."""
        for step in self.steps:
            if isinstance(step, int):
                if not isinstance(obj, list) or step >= len(obj):
                    return False, None
                obj = obj[step]
            elif isinstance(obj, dict) and step in obj:
                obj = obj[step]
            else:
                return False, None
        return True, obj

    def names_a_field_of(self, obj: Any) -> bool:
        """The key's fields up to its first list index are in `obj`: a key that is
        well-formed for the object, though this one's list may be too short."""
        fields = []
        for step in self.steps:
            if isinstance(step, int):
                break
            fields.append(step)
        return SortKey(self.text, tuple(fields)).value(obj)[0]


def parse_sort_key(text: str) -> SortKey:
    """A --sort-by argument; raises SortKeyError saying what is allowed."""
    path = text.strip()
    column = COLUMN_PATHS.get(path.lower())
    if column is not None:
        path = column
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path and not path.startswith("."):
        path = "." + path  # kubectl takes `metadata.name` too
    steps: list[str | int] = []
    position = 0
    while position < len(path):
        match = _STEP.match(path, position)
        if match is None:
            raise SortKeyError(f"{text!r} is not a sort key; allowed: {SORT_BY_HELP}")
        steps.append(match.group(1))
        steps += [int(index) for index in _INDEX.findall(match.group(2))]
        position = match.end()
    if not steps:
        raise SortKeyError(f"{text!r} is not a sort key; allowed: {SORT_BY_HELP}")
    return SortKey(text, tuple(steps))


def _order(found: bool, value: Any) -> tuple[int, Any]:
    """Numbers by value, then strings, then the rest by their JSON text; missing and null
    last (kubectl puts them last too). Booleans sort as numbers (False first)."""
    if not found or value is None:
        return (3, "")
    if isinstance(value, int | float):
        return (0, value)
    if isinstance(value, str):
        return (1, value)
    return (2, repr(value))


def sort_by(items: Sequence[_Item], key: SortKey, obj_of: Callable[[_Item], Any]) -> list[_Item]:
    """`items` ordered by `key` in the object `obj_of` makes of each; stable, so items with
    equal keys keep their order (by name). SortKeyError when no item has the field: a typo
    is said, not shown as an unsorted list."""
    objects = [obj_of(item) for item in items]
    if objects and not any(key.names_a_field_of(obj) for obj in objects):
        raise SortKeyError(
            f"--sort-by {key.text!r}: no job has this field; allowed: {SORT_BY_HELP}"
        )
    keyed = [(key.value(obj), item) for obj, item in zip(objects, items, strict=True)]
    keyed.sort(key=lambda pair: _order(*pair[0]))
    return [item for _, item in keyed]
