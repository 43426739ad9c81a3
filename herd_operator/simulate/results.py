"""What a simulation gives back: each job's outcome and the run's (`SimResult`), apart from
the engine (`engine.py`) that makes them, since the reports, the baselines and the tests read
them without running anything."""

from __future__ import annotations

from dataclasses import dataclass, field

from herd_operator.specs.values import Demand, Placement


@dataclass(frozen=True)
class JobOutcome:
    name: str
    arrival: float
    admitted: float
    finished: float
    requested: int
    gpu_seconds: float
    memory_seconds: float
    resizes: int
    preemptions: int = 0
    max_slowdown: float = 1.0
    """The largest interference slowdown it ran at (1.0: never slowed by a neighbour)."""
    interference: float = 1.0
    """Its working time over what it would have been alone (1.0: never slowed)."""

    @property
    def completion(self) -> float:
        return self.finished - self.arrival

    @property
    def queueing(self) -> float:
        return self.admitted - self.arrival


Step = tuple[str, str, int] | tuple[str, Demand]
"""A call made to the allocator: ("request", Demand), ("release", job, 0) or
("world", job, world size)."""


@dataclass
class SimResult:
    policy: str
    pool_gpus: int
    jobs: list[JobOutcome]
    timeline: list[tuple[float, int, float]]
    """(time, GPUs allocated, GPUs' worth of memory used) after each decision instant."""
    decisions: int
    batches: int
    events: int
    policy_calls: int
    wall_seconds: float
    decide_seconds: float
    """Wall time inside the allocator's batch decisions (arbitrate and its bookkeeping)."""
    policy_seconds: float
    unfinished: list[str]
    steps: list[tuple[float, list[Step], dict[str, Placement]]] = field(default_factory=list)
    """With `record`: each batch's instant, its calls, and every job's placement after it."""
