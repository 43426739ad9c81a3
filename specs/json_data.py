"""Whether a value parsed from YAML is plain JSON data, as policy and engine options must be.

Apart from the models because it is a walk over any parsed value, not a field's rule.
"""

from __future__ import annotations

from typing import Any

MAX_JSON_INT = 2**63
"""Integers in policy params: what JSON readers everywhere take exactly."""


def json_problem(params: dict[str, Any]) -> str | None:
    """Say why `params` is not plain JSON data (str keys, no dates, sets or cycles), or None."""
    # Iterative, so deeply nested YAML cannot exhaust the interpreter's stack.
    on_path: set[int] = set()
    pending: list[tuple[str, object, bool]] = [(key, child, False) for key, child in params.items()]
    while pending:
        path, item, leaving = pending.pop()
        if leaving:
            on_path.discard(id(item))
            continue
        if isinstance(item, dict | list):
            if id(item) in on_path:
                return f"{path}: refers to itself (a YAML alias cycle)"
            on_path.add(id(item))
            pending.append((path, item, True))
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{path}: mapping keys must be strings, got {key!r}"
                pending.append((f"{path}.{key}", child, False))
        elif isinstance(item, list):
            pending.extend((f"{path}[{index}]", child, False) for index, child in enumerate(item))
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_JSON_INT:
            return f"{path}: integers must be within +-2^63, got one of {item.bit_length()} bits"
        elif item is not None and not isinstance(item, str | int | float | bool):
            return (
                f"{path}: must be a string, number, boolean, null, list or mapping, "
                f"got {type(item).__name__} {item}"
            )
    return None
