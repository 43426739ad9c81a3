from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import OperatorHarness, running_harness

pytestmark = pytest.mark.integration


@pytest.fixture
def herd(tmp_path: Path) -> Iterator[OperatorHarness]:
    yield from running_harness(tmp_path)
