"""Queueing: in what order waiting and running jobs claim the pool, and whom to preempt.

Apart from `arbitration.py` because it needs what a decision alone does not know: each job's
history (the GPU-seconds it has attained, since when it runs or waits, how often it was
preempted), which the allocator keeps (`runtime/service.py`). Everything here is a pure
function of that history, the demands and the clock.

Three orders within a priority tier (`QueueConfig.mode`):

- `fifo`: arrival order (the allocator without this module);
- `las`: least attained service first, discretized as Tiresias does (two-dimensional: GPUs x
  seconds held, in queues bounded by `thresholds`; arrival within a queue), so a new job
  goes before one that has run long, and jobs of one queue do not overtake each other;
- `srpt`: least work left first, where a job's work left is estimated from what it has
  attained and the share of its work done (`Demand.done_fraction`, from its epochs); a job
  whose share done is not known is ordered by what it has attained (least attained first).

A job that has waited `starvation_seconds` goes before all others of its tier (oldest wait
first), whatever the order: the starvation bound.

Preemption (`plan`): the jobs that would be admitted if the pool were handed out afresh in
this order, each at its min, skipping one that does not fit (as Tiresias's rounds do), are
the ones that should run. A pending one of them whose min does not fit in what the running
jobs leave above their mins takes the GPUs of running jobs outside that set, lowest ranked
first and only ranked after it, and only if that makes it fit: a job is never preempted for
one that would still not fit. A job may be preempted only if it says it resumes from a
checkpoint (`Demand.resumable`, `spec.training.resumable`: one that does not would start
again from zero, so it is ordered like the others but never preempted), after it ran
`min_run_seconds` in its current run and fewer than `max_preemptions` times: each preemption
costs its launch, its restore and the work since its last checkpoint.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from herd_operator.specs.values import Demand

QUEUE_MODES = ("fifo", "las", "srpt")
DEFAULT_THRESHOLDS = (3600.0, 16 * 3600.0)
"""GPU-seconds bounding the `las` queues: under one GPU-hour, under 16 (the threshold of
Pollux's artifact for Tiresias), the rest."""
DEFAULT_MIN_RUN_SECONDS = 600.0
DEFAULT_MAX_PREEMPTIONS = 8
DEFAULT_STARVATION_SECONDS = 8 * 3600.0
PREEMPTED_FOR = "preempted for "
"""How the reason of a preempted job's (empty) grant begins: the controller stops its workers
on it (`is_preemption`)."""


def is_preemption(reason: str) -> bool:
    """Whether a grant's reason says the queue preempted the job."""
    return reason.startswith(PREEMPTED_FOR)


@dataclass(frozen=True)
class QueueConfig:
    mode: str = "las"
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    preempt: bool = True
    min_run_seconds: float = DEFAULT_MIN_RUN_SECONDS
    """A job runs at least this long (from its latest start) before it may be preempted."""
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    """A job preempted this many times is not preempted again."""
    starvation_seconds: float = DEFAULT_STARVATION_SECONDS
    """A job pending this long (in its current wait) goes first in its tier."""

    def __post_init__(self) -> None:
        if self.mode not in QUEUE_MODES:
            raise ValueError(f"queue mode {self.mode!r}: expected one of {', '.join(QUEUE_MODES)}")
        if list(self.thresholds) != sorted(self.thresholds) or any(
            not (math.isfinite(t) and t > 0) for t in self.thresholds
        ):
            raise ValueError(f"queue thresholds must be increasing and > 0: {self.thresholds}")
        if self.min_run_seconds < 0 or self.max_preemptions < 0:
            raise ValueError("min_run_seconds and max_preemptions must be >= 0")
        if not (math.isfinite(self.starvation_seconds) and self.starvation_seconds > 0):
            raise ValueError(
                f"starvation_seconds must be finite and > 0: {self.starvation_seconds}"
            )


def describe_queue(config: QueueConfig | None) -> str:
    """`fifo`, or the mode and its preemption knobs, for the operator's log."""
    if config is None:
        return "fifo (arrival order, no preemption)"
    if not config.preempt:
        return f"{config.mode} (no preemption)"
    return (
        f"{config.mode} (preempting after {config.min_run_seconds:g} s of a run, at most"
        f" {config.max_preemptions} times a job; {config.starvation_seconds:g} s of waiting"
        " goes first)"
    )


@dataclass(frozen=True)
class Service:
    """One job's history as the allocator kept it."""

    attained: float = 0.0
    """GPU-seconds held, every run of it together."""
    running_since: float | None = None
    """When its current run was granted GPUs; None: it holds none."""
    waiting_since: float | None = None
    """When its current wait began; None: it is not waiting."""
    preemptions: int = 0


NEVER_SERVED = Service()


def work_left(demand: Demand, service: Service) -> float | None:
    """GPU-seconds of work left, estimated as attained x (left / done); None: not known."""
    done = demand.done_fraction
    if done is None or done <= 0 or service.attained <= 0:
        return None
    return service.attained * (1.0 - done) / done


def rank(
    demand: Demand, service: Service, config: QueueConfig, now: float
) -> tuple[int, float, float]:
    """The order within a tier (lowest first): starving jobs by the start of their wait;
    then by the mode's key; arrival breaks ties (the caller adds it)."""
    since = service.waiting_since
    if since is not None and now - since >= config.starvation_seconds:
        return (0, since, 0.0)
    if config.mode == "fifo":
        return (1, 0.0, 0.0)
    if config.mode == "srpt":
        left = work_left(demand, service)
        # Unknown: what it attained stands in (in the same GPU-seconds), as under `las`.
        return (1, 0.0, service.attained if left is None else left)
    return (1, float(bisect.bisect_right(config.thresholds, service.attained)), 0.0)


@dataclass
class Plan:
    """What the allocator hands arbitration: each job's order, and the jobs preempted (with
    why) for the ones they make room for."""

    order: dict[str, tuple[float, ...]]
    preempted: dict[str, str] = field(default_factory=dict)
    admitted_by: dict[str, list[str]] = field(default_factory=dict)
    """Beneficiary -> the jobs preempted for it."""


def plan(
    demands: Sequence[Demand],
    sizes: Mapping[str, int],
    services: Mapping[str, Service],
    config: QueueConfig,
    now: float,
    pool_gpus: int,
    frozen: AbstractSet[str] = frozenset(),
) -> Plan:
    """The order of every job and the preemptions of this decision.

    `sizes`: the GPUs each job holds now (it runs if at least its min); `pool_gpus`: the
    GPUs the decision may hand out; `frozen`: jobs the allocator leaves as they are (never
    preempted). The order puts the jobs that should run first, then the others, each part in
    rank order, so that a large job that does not fit blocks only those ranked after it that
    do not fit either.
    """
    keyed = sorted(
        demands,
        key=lambda d: (-d.priority, rank(d, services.get(d.name, NEVER_SERVED), config, now),
                       d.arrival, d.name),
    )  # fmt: skip
    chosen = _fitting(keyed, pool_gpus)
    chosen_names = {d.name for d in chosen}
    order: dict[str, tuple[float, ...]] = {
        d.name: (0.0 if d.name in chosen_names else 1.0, float(i)) for i, d in enumerate(keyed)
    }
    result = Plan(order)
    if config.preempt:
        running = {d.name for d in demands if sizes.get(d.name, 0) >= d.min}
        free = pool_gpus - sum(d.min for d in demands if d.name in running)
        # Running jobs that should not run, and may be preempted: lowest ranked first.
        outside = [d for d in reversed(keyed) if d.name in running and d.name not in chosen_names]
        victims = [d for d in outside if _preemptible(d, services, config, now, frozen)]
        _preempt(result, chosen, running, free, victims, services)
    return result


def _preempt(
    result: Plan,
    chosen: Sequence[Demand],
    running: AbstractSet[str],
    free: int,
    victims: list[Demand],
    services: Mapping[str, Service],
) -> None:
    """Each pending job of `chosen`, in order, admitted in the `free` GPUs or in those of
    `victims` it may take (recorded in `result`); stops at the first that would not fit."""
    for d in chosen:
        if d.name in running:
            continue
        if d.min <= free:
            free -= d.min
            continue
        taken = _room_for(d, free, victims, result.order)
        if taken is None:
            break  # it would not fit: nobody is preempted for it, and it blocks the rest
        for victim in taken:
            victims.remove(victim)
            result.preempted[victim.name] = f"{PREEMPTED_FOR}{d.name} ({_why(d, victim, services)})"
        result.admitted_by[d.name] = [v.name for v in taken]
        free += sum(v.min for v in taken) - d.min


def _fitting(keyed: Sequence[Demand], pool_gpus: int) -> list[Demand]:
    """The jobs admitted if the pool were handed out afresh in this order, each at its min,
    skipping those that do not fit."""
    budget = pool_gpus
    chosen: list[Demand] = []
    for d in keyed:
        if d.min <= budget:
            chosen.append(d)
            budget -= d.min
    return chosen


def _room_for(
    demand: Demand, free: int, victims: Sequence[Demand], order: Mapping[str, tuple[float, ...]]
) -> list[Demand] | None:
    """The victims (lowest ranked first) whose GPUs make `demand`'s min fit with the `free`
    ones; None if those ranked after it do not suffice."""
    taken: list[Demand] = []
    room = free
    for victim in victims:
        if room >= demand.min or order[victim.name][1] < order[demand.name][1]:
            break  # never for a job ranked before it
        taken.append(victim)
        room += victim.min
    return taken if room >= demand.min else None


def _preemptible(
    demand: Demand,
    services: Mapping[str, Service],
    config: QueueConfig,
    now: float,
    frozen: AbstractSet[str],
) -> bool:
    service = services.get(demand.name, NEVER_SERVED)
    if not demand.resumable:
        return False  # it would start again from zero: ordered like the others, never preempted
    if demand.name in frozen or service.preemptions >= config.max_preemptions:
        return False
    since = service.running_since
    return since is not None and now - since >= config.min_run_seconds


def _why(winner: Demand, victim: Demand, services: Mapping[str, Service]) -> str:
    mine = services.get(victim.name, NEVER_SERVED).attained / 3600
    theirs = services.get(winner.name, NEVER_SERVED).attained / 3600
    return f"attained {mine:.1f} GPU-h against its {theirs:.1f}"
