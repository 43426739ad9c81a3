"""Label selectors (`get -l`): what parses to what, what matches, and what is refused."""

from __future__ import annotations

import pytest

from herd_operator.cli.selectors import (
    Operator,
    Requirement,
    SelectorError,
    parse_selector,
)


def test_every_form_parses_to_its_requirement() -> None:
    selector = parse_selector(
        "team=vision, tier==gpu,owner!=bob,gpu,!old,env in (dev, prod),zone notin (a)"
    )
    assert selector.requirements == (
        Requirement("team", Operator.EQUALS, frozenset({"vision"})),
        Requirement("tier", Operator.EQUALS, frozenset({"gpu"})),
        Requirement("owner", Operator.NOT_EQUALS, frozenset({"bob"})),
        Requirement("gpu", Operator.EXISTS),
        Requirement("old", Operator.NOT_EXISTS),
        Requirement("env", Operator.IN, frozenset({"dev", "prod"})),
        Requirement("zone", Operator.NOT_IN, frozenset({"a"})),
    )


def test_prefixed_keys_and_empty_values_are_labels_too() -> None:
    (requirement,) = parse_selector("example.com/team=").requirements
    assert requirement == Requirement("example.com/team", Operator.EQUALS, frozenset({""}))


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("team=vision", {"team": "vision"}, True),
        ("team=vision", {"team": "nlp"}, False),
        ("team=vision", {}, False),
        ("team!=vision", {}, True),  # as in Kubernetes: not set is not equal
        ("team!=vision", {"team": "vision"}, False),
        ("team", {"team": ""}, True),
        ("!team", {"team": ""}, False),
        ("team in (a,b)", {"team": "b"}, True),
        ("team in (a,b)", {}, False),
        ("team notin (a,b)", {}, True),
        ("team notin (a,b)", {"team": "a"}, False),
        ("team=vision,tier=gpu", {"team": "vision"}, False),  # every requirement must hold
        ("team=vision,tier=gpu", {"team": "vision", "tier": "gpu"}, True),
        ("", {}, True),  # as kubectl's `-l ''`: no requirement, every job
        ("  ", {"team": "vision"}, True),
    ],
)
def test_matching(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert parse_selector(selector).matches(labels) is matches


@pytest.mark.parametrize(
    ("selector", "problem"),
    [
        ("a,,b", "'a,,b': an empty requirement between commas"),
        ("team=", None),
        ("=vision", "'=vision': '' is not a label key"),
        ("team=vi sion", "'team=vi sion': 'vi sion' is not a label value"),
        ("-team=a", "'-team=a': '-team' is not a label key"),
        ("Team.Example/x=a", "'Team.Example/x=a': 'Team.Example/x' is not a label key"),
        ("team=" + "v" * 64, "is not a label value"),
        ("team in (a", "'team in (a': '(' without ')'"),
        ("team in a)", "'team in a)': ')' without '('"),
        ("team in (a b)", "'team in (a b)': 'a b' is not a label value"),
    ],
)
def test_bad_selectors_are_refused_saying_what_is_allowed(
    selector: str, problem: str | None
) -> None:
    if problem is None:
        parse_selector(selector)  # an empty value is a value
        return
    with pytest.raises(SelectorError) as caught:
        parse_selector(selector)
    assert problem in str(caught.value)
    assert "allowed: key=value, key==value, key!=value, key, !key" in str(caught.value)
