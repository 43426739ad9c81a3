"""The order tests/conftest.py gives the suite's files (xdist hands them out in it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import HERE, LONGEST_FIRST, pytest_collection_modifyitems


@dataclass
class FakeItem:
    path: Path
    name: str


def test_every_file_named_to_go_first_exists() -> None:
    """A renamed or deleted file left in the list would only be skipped over, silently."""
    assert [name for name in LONGEST_FIRST if not (HERE / name).is_file()] == []


def test_the_named_files_go_first_in_the_lists_order_and_the_rest_keep_theirs() -> None:
    collected = [
        FakeItem(HERE / "unit" / "test_b.py", "b1"),
        FakeItem(HERE / LONGEST_FIRST[1], "second1"),
        FakeItem(HERE / "unit" / "test_a.py", "a1"),
        FakeItem(HERE / LONGEST_FIRST[0], "first1"),
        FakeItem(HERE / LONGEST_FIRST[1], "second2"),
        FakeItem(Path("/elsewhere/test_c.py"), "c1"),
        FakeItem(HERE / "unit" / "test_b.py", "b2"),
    ]
    items: list[Any] = list(collected)
    pytest_collection_modifyitems(items)
    assert [item.name for item in items] == ["first1", "second1", "second2", "b1", "a1", "c1", "b2"]
