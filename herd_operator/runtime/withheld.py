"""The GPUs a decision may not hand to a job, and grants cut to what they may hold: pure
functions of the allocator's state, tested on their own.

Apart from the allocator because they are decisions (no clock, no lock, no I/O) that the
arbitration itself does not make: it knows no drains in progress, no held jobs, no nodes
in doubt.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot

log = logging.getLogger("herd_operator.runtime.allocator")


def only(placement: Placement, slots: AbstractSet[Slot]) -> Placement:
    """`placement` without the GPUs not in `slots`; the order stays (position i on a host
    is the GPU of local rank i)."""
    hosts = tuple(
        (host, tuple(gpu for gpu in gpus if (host, gpu) in slots)) for host, gpus in placement.hosts
    )
    return Placement(tuple((host, gpus) for host, gpus in hosts if gpus))


def withheld_slots(
    pool: Pool,
    overdue: AbstractSet[Slot],
    held: Mapping[str, Placement],
    doubted_hosts: AbstractSet[str],
    current: Mapping[str, Placement],
    demands: Mapping[str, Demand],
) -> set[Slot]:
    """GPUs a decision shares out to nobody: those draining past their deadline (`overdue`:
    they may never be seen free, so no decision counts on them), those of `held` jobs
    (adopted, not asked for yet), and the GPUs of cordoned, suspect or lost hosts
    (`doubted_hosts`) that no job keeps in it: a job keeps its `current` placement (a job
    shrunk to the workers it still has, not the GPUs it gave up), unless it is being
    released (it has no demand any more)."""
    withheld = set(overdue)
    for placement in held.values():
        withheld.update(placement.slots())
    if doubted_hosts:
        kept = {
            slot
            for job, placement in current.items()
            if job in demands
            for slot in placement.slots()
        }
        withheld.update(
            (host, gpu)
            for host, gpus in pool.hosts
            if host in doubted_hosts
            for gpu in gpus
            if (host, gpu) not in kept
        )
    return withheld


def wait_for_drains(
    decided: dict[str, Grant],
    current: Mapping[str, Placement],
    draining: Mapping[Slot, str],
    demands: Mapping[str, Demand],
    previous: Mapping[str, Grant],
) -> None:
    """Take the `draining` GPUs (slot -> the job giving it back) out of the grants of
    `decided`: they go to no job yet.

    A decision counts GPUs being given back as the pool's (they will be free) and places
    them last (`arbitrate`'s `draining`), but they are not free yet: the workers of the job
    that gave one back leave it only when Horovod removes them. A running job that was to
    get one grows by the rest of its grant. A job to be admitted waits, pending, until a
    later decision, once they drained, gives it all of its grant at once: its share is
    counted for it meanwhile, so nobody else grows into it, and the jobs that shrank for it
    stay shrunk, so it takes no more than it needs. (Deciding without those GPUs took GPUs
    from another job, which went to the waiting one at once while that job's workers were
    still on them; and a job started on part of its grant was frozen at it while the rest
    went elsewhere.) A grant left as it was in `previous` is that very Grant.
    """
    for job, grant in list(decided.items()):
        before = current.get(job, Placement.EMPTY)
        if grant.placement is before or grant.placement == before:
            continue  # most jobs keep their placement: they took no GPU
        # Only GPUs new to the job: one it holds already is its own (on a GPU shared by
        # memory another job may be giving back the same GPU: that is no wait for this one).
        held = set(before.slots())
        taken = {slot for slot in grant.placement.slots() if slot in draining and slot not in held}
        if not taken:
            continue
        givers = ", ".join(sorted({draining[slot] for slot in taken}))
        wait = f"waiting for GPUs that {givers} gave back to drain (its workers leave them first)"
        demand = demands.get(job)
        if demand is None or before.size < demand.min:
            decided[job] = Grant(Placement.EMPTY, f"pending: {wait}")
            continue
        rest = only(grant.placement, set(grant.placement.slots()) - taken)
        earlier = previous.get(job)
        if earlier is not None and earlier.placement == rest:
            decided[job] = earlier
        else:
            decided[job] = Grant(rest, f"{grant.reason}; {len(taken)} more {wait}")


def restorable(
    pool: Pool, placements: Mapping[str, Placement], shared: AbstractSet[str] = frozenset()
) -> tuple[dict[str, Placement], set[Slot]]:
    """What a restarted allocator takes back of the placements adopted jobs held: each job's
    GPUs that are still in the pool and not already taken by a job restored before it (in
    name order; a GPU may be restored for several `shared` jobs, which share GPUs by memory);
    jobs left with none hold nothing. Returns them, and every slot taken."""
    in_pool = pool.slot_set
    owners: dict[Slot, str] = {}
    kept: dict[str, Placement] = {}
    for job, placement in sorted(placements.items()):
        slots = [
            s
            for s in placement.slots()
            if s in in_pool and (s not in owners or (job in shared and owners[s] in shared))
        ]
        if len(slots) != placement.size:
            log.warning(
                "%s: %d of its %d GPUs are not restored (gone from the pool, or held by"
                " another job)",
                job, placement.size - len(slots), placement.size,
            )  # fmt: skip
        if slots:
            for slot in slots:
                owners.setdefault(slot, job)
            kept[job] = only(placement, set(slots))
    return kept, set(owners)
