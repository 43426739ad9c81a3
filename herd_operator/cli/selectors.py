"""Label selectors as kubectl reads them (`get -l team=vision,tier!=batch,gpu`).

A selector is requirements joined by commas; a job matches when it meets all of them:

    key=value, key==value   the label is set to value
    key!=value              the label is not set to value (or not set at all)
    key                     the label is set (to anything)
    !key                    the label is not set
    key in (a,b)            the label is set to one of the values
    key notin (a,b)         the label is not set to any of them (or not set)

Keys and values follow Kubernetes' label syntax (herd_operator/specs/labels.py, which the
spec's labels are checked with too), so a selector that works here works with kubectl too,
any label a spec has can be selected, and a typo is refused with what is allowed instead
of matching nothing. An empty selector matches every job.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from herd_operator.specs.labels import (
    LABEL_KEY_RULE,
    LABEL_VALUE_RULE,
    is_label_key,
    is_label_value,
)

_SET_REQUIREMENT = re.compile(r"(?P<key>[^\s()!=]+)\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)")
SYNTAX_HELP = (
    "allowed: key=value, key==value, key!=value, key, !key, 'key in (a,b)', "
    "'key notin (a,b)', joined by commas"
)


class SelectorError(ValueError):
    """A selector that does not parse; the message says which part and what is allowed."""


class Operator(enum.Enum):
    EQUALS = "="
    NOT_EQUALS = "!="
    EXISTS = "exists"
    NOT_EXISTS = "!"
    IN = "in"
    NOT_IN = "notin"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.operator:
            case Operator.EXISTS:
                return value is not None
            case Operator.NOT_EXISTS:
                return value is None
            case Operator.EQUALS | Operator.IN:
                return value in self.values
            case Operator.NOT_EQUALS | Operator.NOT_IN:
                return value not in self.values


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Every requirement holds (an empty selector matches every job)."""
        return all(requirement.matches(labels) for requirement in self.requirements)


def parse_selector(text: str) -> Selector:
    """Parse a `-l/--selector` argument; raises `SelectorError` naming the bad part.

    An empty selector (`-l ''`) has no requirement, so it matches every job, as kubectl's
    does (a script that builds a selector may have nothing to add)."""
    return Selector(tuple(_parse_requirement(part) for part in _split(text)))


def _split(text: str) -> list[str]:
    """The comma-separated parts, keeping the commas inside `in (a,b)` in their part."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"{text!r}: ')' without '('; {SYNTAX_HELP}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise SelectorError(f"{text!r}: '(' without ')'; {SYNTAX_HELP}")
    parts.append(text[start:])
    if len(parts) > 1 and any(not part.strip() for part in parts):
        raise SelectorError(f"{text!r}: an empty requirement between commas; {SYNTAX_HELP}")
    return [part.strip() for part in parts if part.strip()]


def _parse_requirement(part: str) -> Requirement:
    if set_match := _SET_REQUIREMENT.fullmatch(part):
        values = [value.strip() for value in set_match.group("values").split(",")]
        key = _key(set_match.group("key"), part)
        operator = Operator.IN if set_match.group("op") == "in" else Operator.NOT_IN
        return Requirement(key, operator, frozenset(_value(value, part) for value in values))
    for symbol, operator in (("!=", Operator.NOT_EQUALS), ("==", Operator.EQUALS)):
        if symbol in part:
            key, value = part.split(symbol, 1)
            return Requirement(_key(key, part), operator, frozenset({_value(value, part)}))
    if "=" in part:
        key, value = part.split("=", 1)
        return Requirement(_key(key, part), Operator.EQUALS, frozenset({_value(value, part)}))
    if part.startswith("!"):
        return Requirement(_key(part[1:], part), Operator.NOT_EXISTS)
    return Requirement(_key(part, part), Operator.EXISTS)


def _key(key: str, part: str) -> str:
    key = key.strip()
    if not is_label_key(key):
        raise SelectorError(
            f"{part!r}: {key!r} is not a label key ({LABEL_KEY_RULE}); {SYNTAX_HELP}"
        )
    return key


def _value(value: str, part: str) -> str:
    value = value.strip()
    if not is_label_value(value):
        raise SelectorError(
            f"{part!r}: {value!r} is not a label value ({LABEL_VALUE_RULE}); {SYNTAX_HELP}"
        )
    return value
