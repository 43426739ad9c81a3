"""The allocator's placement sink for tests that build an `Allocator` without engines.

`RecordingSink` keeps each job's last placement as the allocator hands it out (a grant
file's content, without the file); a test that does not look at it passes one all the same.
"""

from __future__ import annotations

from herd_operator.specs.values import Placement


class RecordingSink:
    """A `PlacementSink`: `published` is each job's last placement, until it is withdrawn."""

    def __init__(self) -> None:
        self.published: dict[str, Placement] = {}

    def publish(self, job: str, placement: Placement) -> None:
        self.published[job] = placement

    def withdraw(self, job: str) -> None:
        self.published.pop(job, None)
