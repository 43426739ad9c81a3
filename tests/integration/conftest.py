from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import OperatorHarness, running_harness

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything in this directory runs real processes: mark it, for `-m integration`."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def herd(tmp_path: Path) -> Iterator[OperatorHarness]:
    yield from running_harness(tmp_path)
