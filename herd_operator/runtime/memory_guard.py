"""The allocator's side of the sharing guard (`policies/sharing_guard.py`): what the sharing
jobs' workers use now, each sampling round, turned into the step the allocator takes.

Apart from the allocator (at its size bound) because it is a translation: the allocator's
demands and grants into the guard's `Sharer`s, the GPUs no worker may move to, and the
guard's decision back into one step: the raised demands, the events (a job that cannot be
moved is said once, until it can be or is no longer near), and at most one job's new grant
per round, applied by the allocator like a lost worker's shrink (the GPU its worker leaves
drains, the grant is kept exactly in that decision, every other job decided again). One job
a round keeps each step a decision on the state it was computed from; a second job near its
share is looked at again a round later.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from herd_operator.policies.sharing import SharingLimits
from herd_operator.policies.sharing_guard import (
    NEAR_SHARE_RATIO,
    CleanChange,
    GuardAction,
    Sharer,
    guard_sharing,
)
from herd_operator.runtime.recording import EventSink
from herd_operator.runtime.withheld import withheld_slots
from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardStep:
    demands: dict[str, Demand] = field(default_factory=dict)
    """Demands counted from now by what their workers use (raised `measured_bytes`)."""
    shrink: tuple[str, Grant] | None = None
    """The one job whose grant changes in this step, with it (the allocator's `_decide`
    keeps it exactly, as a lost worker's shrink)."""


class MemoryGuard:
    """Not thread-safe: the allocator calls it under its lock."""

    def __init__(self, limits: SharingLimits | None, near_ratio: float = NEAR_SHARE_RATIO):
        self.limits = limits
        self.near_ratio = near_ratio
        self._said: set[tuple[str, Slot]] = set()
        """(job, GPU) of workers said not movable, until they are no longer."""

    def step(
        self,
        pool: Pool,
        demands: Mapping[str, Demand],
        grants: Mapping[str, Grant],
        held: Mapping[str, Placement],
        draining: AbstractSet[Slot],
        doubted_hosts: AbstractSet[str],
        used: Mapping[str, Mapping[Slot, int | None]],
        record_event: EventSink,
        clean: CleanChange,
    ) -> GuardStep:
        """The step for this round's `used` (job -> GPU -> bytes its worker there uses, None
        unknown); its events go to `record_event`; `clean`: whether a job's engine sees a
        change of its placement as it is (`BindingTracker.moves_cleanly`). No worker moves to
        a GPU `draining`, of a `held` job (adopted, not asked for yet) or on a doubted host;
        `grants` of jobs not in `demands` (held, released) are left alone."""
        limits = self.limits
        capacity = pool.gpu_memory_bytes or (limits.gpu_memory_bytes if limits else None)
        if limits is None or capacity is None:
            return GuardStep()
        if not any((d := demands.get(job)) is not None and d.share for job in used):
            self._said = set()
            return GuardStep()  # most rounds of most pools: no sharing job's memory was read
        no_new = withheld_slots(pool, draining, held, doubted_hosts, {}, {})
        sharers, closed = _sharers(demands, grants, used)
        decision = guard_sharing(
            pool.slots(), sharers, capacity=capacity, max_jobs_per_gpu=limits.max_jobs_per_gpu,
            margin=limits.margin, closed=closed, no_new=no_new,
            near_ratio=self.near_ratio, clean=clean,
        )  # fmt: skip
        changed = decision.jobs_changed()
        first = changed[0] if changed else None
        raised = {
            job: dataclasses.replace(demands[job], measured_bytes=measured)
            for job, measured in decision.measured.items()
            if job not in changed[1:] and measured != demands[job].measured_bytes
        }
        self._say(decision.actions, first, record_event)
        if first is None:
            return GuardStep(raised)
        return GuardStep(raised, (first, _grant([a for a in decision.actions if a.job == first])))

    def _say(
        self, actions: Sequence[GuardAction], first: str | None, record_event: EventSink
    ) -> None:
        """The events of a step: the changed job's, and each job newly not movable."""
        stuck = {(a.job, a.gpu) for a in actions if a.kind == "stuck"}
        for action in actions:
            if action.kind == "stuck" and (action.job, action.gpu) not in self._said:
                log.warning("%s: %s", action.job, action.message, extra={"job": action.job})
                record_event(action.job, "Warning", action.reason, action.message)
            elif action.job == first:
                log.info("%s: %s", action.job, action.message, extra={"job": action.job})
                record_event(action.job, "Normal", action.reason, action.message)
        self._said = stuck


def _sharers(
    demands: Mapping[str, Demand],
    grants: Mapping[str, Grant],
    used: Mapping[str, Mapping[Slot, int | None]],
) -> tuple[list[Sharer], set[Slot]]:
    """The sharing jobs with GPUs as the guard sees them, and the GPUs of every other job
    (whole GPUs, or not ours to weigh: held, released)."""
    sharers: list[Sharer] = []
    closed: set[Slot] = set()
    for job, grant in grants.items():
        demand = demands.get(job)
        if demand is None or not demand.share or not grant.placement.size:
            closed.update(grant.placement.slots())
            continue
        readable = {slot: b for slot, b in used.get(job, {}).items() if b is not None}
        sharers.append(
            Sharer(job, grant.placement, demand.min, demand.memory_bytes,
                   demand.measured_bytes, readable, demand.memory_split_bytes)
        )  # fmt: skip
    return sharers, closed


def _grant(actions: list[GuardAction]) -> Grant:
    placement: Placement = actions[0].placement
    what = "; ".join(
        f"{a.gpu[0]}:{a.gpu[1]} -> {a.to[0]}:{a.to[1]}" if a.to is not None
        else f"{a.gpu[0]}:{a.gpu[1]} given up"
        for a in actions
    )  # fmt: skip
    return Grant(placement, f"memory over its share (sharing): {what}")
