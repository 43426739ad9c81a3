"""Shrinking sharing jobs to admit a waiting one (`SharingLimits.shrink_to_admit`): what
`arbitrate` does for whole-GPU jobs (a pending job's min before anyone's GPUs above their
own min), for the jobs `sharing.pack` places by memory.

Pure, as `sharing.py` (which calls it and documents the rules); apart from it to keep each
module short enough to read. The rules:

- Only the head of the line is admitted this way: the first pending sharing job that may
  open a free GPU and did not fit (`sharing._Growth.head`). Nobody overtakes it, as
  without the option.
- It counts the GPUs being given back (draining), as `arbitrate` counts them for
  admission: its grant then waits for them to drain (the allocator's `wait_for_drains`),
  and the next decision admits it there again instead of shrinking others once more.
- It may take workers of running sharing jobs of its priority or lower, not frozen (resized
  recently), each down to that job's min and never below. Whether they hold a GPU alone or
  share it does not matter.
- GPUs are cleared cheapest first: the fewest workers to take off for the waiting job to
  fit there (memory, jobs per GPU, utilization cap), then the last in pool order first. On
  a GPU, the worker of the job ranked last goes first.
- A job that shrinks may need more memory per worker on the GPUs it keeps (its batch is
  split among fewer workers, `Demand.memory_split_bytes`); a worker is taken off only where
  that fits, so no GPU is ever over-committed.
- The waiting job is then admitted by the packing's own search (`admit`). If its min does
  not fit even so, nothing changes: no job is shrunk for an admission that does not happen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from herd_operator.policies.sharing_room import Packing, within_utilization
from herd_operator.specs.values import Demand, Slot


class Shrinker:
    """Clears GPUs for a waiting sharing job by taking running jobs' workers above their min
    (the module docstring's rules). Works on the packing's state in place: `held` (each
    job's GPUs), `gpus` and `where` (`Packing`)."""

    def __init__(self, packing: Packing) -> None:
        self._ranked = packing.ranked
        self._position = {d.name: index for index, d in enumerate(packing.ranked)}
        self._held = packing.held
        self._needs = packing.needs
        self._gpus = packing.gpus
        self._where = packing.where
        self._frozen = packing.frozen
        self.shrunk_for: dict[str, str] = {}
        """Each job shrunk, and the job it was shrunk to admit (for its reason)."""

    def admit(
        self, head: Demand, admit: Callable[[Demand], Sequence[Slot] | None], pool_size: int
    ) -> bool:
        """Shrink jobs so that `head` (pending) fits, and admit it with `admit` (the packing's
        own admission, None when its min did not fit); whether it was admitted. When it was
        not, the state is as before."""
        need = self._needs.at(head, head.min)
        if need > self._gpus.capacity or head.min > pool_size:
            return False  # no GPU, or not enough of them, could ever hold it
        self._gpus.counting_drains = True
        try:
            return self._admit(head, need, admit)
        finally:
            self._gpus.counting_drains = False

    def _admit(
        self, head: Demand, need: int, admit: Callable[[Demand], Sequence[Slot] | None]
    ) -> bool:
        donors = {
            d.name: d
            for d in self._ranked
            if d.name != head.name
            and d.priority <= head.priority
            and d.name not in self._frozen
            and len(self._held[d.name]) > d.min
        }
        saved = (self._gpus.copy(), self._where.saved(), dict(self._held))
        fitting = self._where.best(head.name, [], need, head.min, True)
        short = head.min - len(fitting)
        for slot in self._cheapest(head, need, donors, set(fitting)):
            if short <= 0:
                break
            plan = self._clearing(slot, head, need, donors)
            if plan is not None:  # every donor of it can give its worker there: all or none
                for job in plan:
                    self._take(donors[job], slot)
                short -= 1
        if short <= 0 and admit(head) is not None:
            for job in donors:
                if len(self._held[job]) < len(saved[2][job]):
                    self.shrunk_for[job] = head.name
            return True
        gpus, free, held = saved
        self._gpus.restore(gpus)
        self._where.restore(free)
        self._held.clear()
        self._held.update(held)
        return False

    def _cheapest(
        self, head: Demand, need: int, donors: Mapping[str, Demand], fitting: AbstractSet[Slot]
    ) -> list[Slot]:
        """The GPUs a donor is on that `head` does not fit now, by the workers to take off
        for it to fit there (fewest first), then the last in pool order first (a job's
        last GPUs go first, as `arbitrate` cuts a job from its tail)."""
        order: dict[Slot, tuple[int, int]] = {}
        for job in donors:
            for slot in self._held[job]:
                if slot in order or slot in fitting:
                    continue
                plan = self._clearing(slot, head, need, donors)
                if plan is not None:
                    order[slot] = (len(plan), -self._where.position(slot))
        return sorted(order, key=order.__getitem__)

    def _clearing(
        self, slot: Slot, head: Demand, need: int, donors: Mapping[str, Demand]
    ) -> list[str] | None:
        """The donors' workers to take off `slot` for `head` to fit there (ranked last
        first, each donor above its min and able to give it, `_gives`), or None: it cannot
        be made to fit."""
        gpus = self._gpus
        if slot in gpus.closed or not gpus.open_to_new(slot):
            return None
        staying = set(gpus.jobs.get(slot, ()))
        used = gpus.used.get(slot, 0)
        busy = gpus.busy.get(slot, 0.0)
        takable = sorted(
            (job for job in staying if job in donors and self._above_min(donors[job])),
            key=lambda job: -self._position[job],
        )
        plan: list[str] = []
        added: dict[Slot, int] = {}
        for job in takable:
            if self._fits(head, need, len(staying), used, busy):
                break
            if not self._gives(donors[job], slot, added):
                continue
            size = len(self._held[job])
            used -= self._needs.at(donors[job], size)
            busy -= gpus.busy_of.get(job, 1.0)
            staying.discard(job)
            plan.append(job)
        return plan if plan and self._fits(head, need, len(staying), used, busy) else None

    def _fits(self, head: Demand, need: int, count: int, used: int, busy: float) -> bool:
        gpus = self._gpus
        joining = gpus.busy_of.get(head.name, 1.0)
        return (
            count < gpus.max_jobs
            and used + need <= gpus.capacity
            and (count == 0 or within_utilization(busy, joining, gpus.max_busy))
        )

    def _above_min(self, demand: Demand) -> bool:
        return len(self._held[demand.name]) > demand.min

    def _gives(self, donor: Demand, slot: Slot, added: dict[Slot, int]) -> bool:
        """Whether `donor` can give its worker on `slot`: where it splits its batch, its
        other workers then need more each, which their GPUs must have (beyond what the
        plan's earlier donors add there, `added`, updated when it can). A plan is made of
        such donors only: one that failed part-way left the workers it had taken off, and
        the head, admitted on another GPU, left a donor shrunk for nothing."""
        mine = self._held[donor.name]
        more = self._needs.at(donor, len(mine) - 1) - self._needs.at(donor, len(mine))
        others = [other for other in mine if other != slot]
        gpus = self._gpus
        if more > 0 and any(
            gpus.used[other] + added.get(other, 0) + more > gpus.capacity for other in others
        ):
            return False
        for other in others:
            added[other] = added.get(other, 0) + max(more, 0)
        return True

    def _take(self, donor: Demand, slot: Slot) -> None:
        """Take `donor`'s worker off `slot` (its size one less; `_gives` said it can): its
        other workers are counted for what a worker needs at that size."""
        mine = self._held[donor.name]
        now = self._needs.at(donor, len(mine))
        more = self._needs.at(donor, len(mine) - 1) - now
        rest = [other for other in mine if other != slot]
        gpus = self._gpus
        if gpus.remove(slot, donor.name, now):
            self._where.freed(slot)
        for other in rest:
            gpus.used[other] += more
        self._held[donor.name] = rest
