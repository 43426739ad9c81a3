"""Shrinking sharing jobs to admit a waiting whole-GPU job (`SharingLimits.shrink_to_admit`,
across kinds): what `arbitrate` does for a whole-GPU job waiting on whole-GPU jobs, and
`sharing_shrink.py` for a sharing job waiting on sharing jobs, for a whole-GPU job waiting
on GPUs that sharing jobs hold.

Pure, as `sharing.py` (which calls it and documents the rules); apart from it to keep each
module short enough to read. The rules:

- Only while a whole-GPU job waits (after the decision without it), for the waiting jobs
  of the highest priority among them: they may take GPUs of sharing jobs of their priority
  or lower, not frozen (resized recently), each of those jobs down to its min and never
  below. A GPU is freed only whole: every sharing job on it gives its worker there.
- GPUs are freed cheapest first (the fewest sharing workers on them), then the last in
  pool order first, one more at a time until a waiting job is admitted by the whole-GPU
  arbitration itself (the decision is made again with those GPUs counted as free), at most
  as many as the largest min of the waiting jobs.
- It is kept only where nobody is shrunk for nothing or past what it gives: every GPU
  freed is held by a whole-GPU job; the whole-GPU jobs admitted in this decision (the
  waiting one, or one that arrived with it and comes first) hold as many GPUs more than
  without the freeing as were freed (counted, not by name: a freed GPU may go to a
  higher-priority job's growth on its own host while the waiting job takes the free GPU
  that growth took before; required by name, the waiting job was left out, and the next
  decision, with that growth done, admitted it: deciding twice changed the result); and
  every sharing job keeps the GPUs it held but those (a job that splits its batch needs
  more per worker at a smaller size; where its other GPUs lack it, the packing would shrink
  it further or move a neighbour, and then nothing changes). Else nothing changes.
- Then again for the next waiting job, until none is admitted this way: deciding again
  on the result changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from herd_operator.specs.values import Demand, Grant, Placement, Slot

Decision = tuple[dict[str, Grant], dict[str, tuple[Placement, str]]]
"""The whole-GPU jobs' grants and the sharing jobs' packing (placement, reason)."""


def shrink_for_whole(
    demands: Sequence[Demand],
    first: Decision,
    decide: Callable[[AbstractSet[Slot]], Decision],
    *,
    frozen: AbstractSet[str],
    fixed: AbstractSet[Slot],
    position: Mapping[Slot, int],
    arriving: AbstractSet[str],
) -> tuple[Decision, dict[str, str]]:
    """The decision with sharing jobs shrunk for waiting whole-GPU jobs (the module
    docstring's rules), and each sharing job that gave a GPU with the job holding it now.
    `first`: the decision without it; `decide(freed)`: the decision again with the GPUs
    `freed` taken from the sharing jobs that hold them; `fixed`: GPUs never freed (held for
    adopted jobs); `position`: each GPU's place in the pool's order; `arriving`: the jobs
    that held no GPU before this decision."""
    by_name = {d.name: d for d in demands}
    before = {name: grant.placement.size for name, grant in first[0].items() if name in arriving}
    decision, freed = first, frozenset[Slot]()
    while True:
        found = _next(by_name, decision, decide, freed, frozen, fixed, position, before)
        if found is None:
            break
        decision, freed = found
    holder = {slot: name for name, grant in decision[0].items() for slot in grant.placement.slots()}
    admitted = [name for name, size in before.items() if decision[0][name].placement.size > size]
    return decision, {
        name: holder[slot] if holder[slot] in before else admitted[0]
        for name, (placement, _) in first[1].items()
        for slot in placement.slots()
        if slot in freed
    }


def _on(packed: Mapping[str, tuple[Placement, str]]) -> dict[Slot, list[str]]:
    on: dict[Slot, list[str]] = {}
    for name, (placement, _) in packed.items():
        for slot in placement.slots():
            on.setdefault(slot, []).append(name)
    return on


def _next(
    by_name: Mapping[str, Demand],
    decision: Decision,
    decide: Callable[[AbstractSet[Slot]], Decision],
    freed: frozenset[Slot],
    frozen: AbstractSet[str],
    fixed: AbstractSet[Slot],
    position: Mapping[Slot, int],
    before: Mapping[str, int],
) -> tuple[Decision, frozenset[Slot]] | None:
    """The decision with GPUs freed for one more waiting whole-GPU job, and all the GPUs
    freed so far; None: none can be admitted so. `before`: the GPUs each job arriving in
    this decision is given without any freeing."""
    grants, packed = decision
    waiting = [by_name[name] for name, grant in grants.items() if not grant.placement.size]
    if not waiting:
        return None
    top = max(d.priority for d in waiting)
    heads = [d for d in waiting if d.priority == top]
    on = _on(packed)
    budget = _budgets(by_name, packed, top, frozen)
    candidates = sorted(
        (slot for slot, names in on.items() if slot not in fixed and budget.keys() >= set(names)),
        key=lambda slot: (len(on[slot]), -position[slot]),
    )
    chosen: list[Slot] = []
    for slot in candidates:
        if len(chosen) >= max(d.min for d in heads):
            return None
        if any(budget[name] < 1 for name in on[slot]):
            continue
        for name in on[slot]:
            budget[name] -= 1
        chosen.append(slot)
        trial = decide(freed | set(chosen))
        if any(trial[0][d.name].placement.size for d in heads):
            taken = freed | set(chosen)
            return (trial, taken) if _pays(trial, packed, set(chosen), taken, before) else None
    return None


def _budgets(
    by_name: Mapping[str, Demand],
    packed: Mapping[str, tuple[Placement, str]],
    top: int,
    frozen: AbstractSet[str],
) -> dict[str, int]:
    """The sharing jobs that may give workers to a waiting job of priority `top` (of its
    priority or lower, not frozen, above their min), and how many each may give."""
    budget = {}
    for name, (placement, _) in packed.items():
        d = by_name[name]
        if d.priority <= top and name not in frozen and placement.size > d.min:
            budget[name] = placement.size - d.min
    return budget


def _pays(
    trial: Decision,
    packed: Mapping[str, tuple[Placement, str]],
    chosen: AbstractSet[Slot],
    taken: AbstractSet[Slot],
    before: Mapping[str, int],
) -> bool:
    """Whether `trial`, with the GPUs `taken` freed (`chosen` at this step), shrinks nobody
    for nothing (the module docstring's rule)."""
    grants, after = trial
    return (
        _held(grants) >= taken
        and _gained(grants, before) >= len(taken)
        and _kept(packed, after, chosen)
    )


def _held(grants: Mapping[str, Grant]) -> set[Slot]:
    """The GPUs the whole-GPU jobs are granted."""
    return {slot for grant in grants.values() for slot in grant.placement.slots()}


def _gained(grants: Mapping[str, Grant], before: Mapping[str, int]) -> int:
    """The GPUs the jobs arriving in this decision hold beyond what they had without any
    freeing."""
    return sum(max(0, grants[name].placement.size - size) for name, size in before.items())


def _kept(
    before: Mapping[str, tuple[Placement, str]],
    after: Mapping[str, tuple[Placement, str]],
    chosen: AbstractSet[Slot],
) -> bool:
    """Whether every sharing job keeps the GPUs it held but `chosen`."""
    return all(
        set(placement.slots()) - chosen <= set(after[name][0].slots())
        for name, (placement, _) in before.items()
    )
