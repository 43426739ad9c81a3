"""What the state store keeps of a job: its identity, its last good spec and its status.

A value every layer speaks: the control loop reads and writes it through its store port,
the store builds it, and the CLI shows it. Here, beside the models it holds, so that none
of them imports another layer for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from herd_operator.specs.models import HerdJob
    from herd_operator.specs.status import HerdJobStatus


@dataclass(frozen=True)
class JobRecord:
    """A job as the store last recorded it: its last good spec and its status, parsed.

    The store owns their serialization; specs and statuses are immutable models, so a
    record can share them with the store's cache and with the spec directory.
    """

    name: str
    uid: str
    """Changes when a job is deleted and declared again under the same name."""
    spec_path: str
    fingerprint: str
    generation: int
    """Bumped by each change of the spec's fingerprint: (uid, generation) fixes the spec."""
    status: HerdJobStatus
    created_at: float
    updated_at: float
    load_spec: Callable[[], HerdJob] = field(repr=False, compare=False)
    """Gives `spec`. The reconciler reads the spec from the spec directory and needs the
    stored one only while the file is invalid, so the store parses it on first use: a
    restarted operator does not hold a second parsed copy of every spec."""

    @property
    def spec(self) -> HerdJob:
        """The last good spec: the one the operator acts on while the file is invalid."""
        return self.load_spec()
