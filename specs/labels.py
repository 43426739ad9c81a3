"""Kubernetes' syntax of label keys and values, in one place for the spec's validation, its
JSON Schema and the CLI's selectors: a label the spec accepts is one a selector can name.

Apart from the models because the selector parser (herd_operator/cli/selectors.py) needs
these patterns without the models, and the schema states the same patterns verbatim.

    key:   [prefix/]name   prefix: a DNS-1123 subdomain (lowercase, at most 253 characters)
                           name: at most 63 of [A-Za-z0-9-_.], starting and ending with
                           a letter or digit
    value: empty, or as a key's name
"""

from __future__ import annotations

import re

LABEL_NAME_MAX_LENGTH = 63
LABEL_PREFIX_MAX_LENGTH = 253
LABEL_KEY_MAX_LENGTH = LABEL_PREFIX_MAX_LENGTH + 1 + LABEL_NAME_MAX_LENGTH

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
# The lookahead bounds the prefix: a key holds one '/' at most, so `.{1,253}/` can only end
# at the prefix's own. Anchored, as JSON Schema patterns are not anchored by themselves; the
# same text is a Python and an ECMA 262 pattern (the schema carries it as is).
LABEL_KEY_PATTERN = rf"^((?=.{{1,{LABEL_PREFIX_MAX_LENGTH}}}/){_PREFIX}/)?{_NAME}$"
LABEL_VALUE_PATTERN = rf"^({_NAME})?$"

LABEL_KEY_RULE = (
    "letters, digits, '-', '_' and '.', at most 63, starting and ending with a letter or "
    "digit, optionally after a DNS subdomain prefix (lowercase, at most 253) and '/'"
)
LABEL_VALUE_RULE = (
    "letters, digits, '-', '_' and '.', at most 63, starting and ending with a letter or "
    "digit, or empty"
)

_KEY = re.compile(LABEL_KEY_PATTERN)
_VALUE = re.compile(LABEL_VALUE_PATTERN)


def is_label_key(key: str) -> bool:
    # The length first: the pattern never sees a megabyte of text.
    return len(key) <= LABEL_KEY_MAX_LENGTH and _KEY.fullmatch(key) is not None


def is_label_value(value: str) -> bool:
    return len(value) <= LABEL_NAME_MAX_LENGTH and _VALUE.fullmatch(value) is not None


def label_problem(key: str, value: str) -> str | None:
    """Why `key: value` is not a Kubernetes label (naming the part), or None."""
    if not is_label_key(key):
        return f"{key!r} is not a label key ({LABEL_KEY_RULE})"
    if not is_label_value(value):
        return f"label {key!r}: {value!r} is not a label value ({LABEL_VALUE_RULE})"
    return None
