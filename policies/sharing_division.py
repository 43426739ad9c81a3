"""Sharing only where the division of whole GPUs leaves a job waiting
(`SharingLimits.share_when_waiting`): under an elastic allocator (one that divides the GPUs
above the mins by speedup or by gain, or by fair share up to the wishes), each sharing job
takes the size that division gives it, as if no GPU were shared, and only the jobs the
division leaves waiting are admitted by sharing a GPU, at their min.

Pure, as `sharing.py` (whose `pack` calls it and whose docstring has the other rules); apart
from it to keep each module short enough to read. Why: with every job sharing, the packing
grew each job up to what it wanted in rank order, onto shared GPUs first, so the division
the elastic policy relies on (`arbitrate`'s, e.g. `share_by_speedup`) never reached the
sharers; in the simulator the best elastic policy ran 65-71% slower with sharing than
without (docs/simulation.md, session 10). The rules:

- The division is `arbitrate`'s counting (`arbitration.divided_sizes`, with the
  allocator's options) over the sharing jobs, in the decision's order (the queue's, or
  smallest first), of the GPUs they may use: the pool less those the jobs that do not share
  were granted (decided first, as without the option), less those nobody may be given.
  Each job is counted as if it held no GPU (its mins in the decision's order, not the
  running ones' first), but a frozen one (resized recently), which keeps its size. So the
  division does not depend on where the jobs are now, and a decision made again on its
  result is the same (counted from what each held, a job admitted by sharing held its min
  in the next division and took it from the others). No job loses its place by it: one
  the division leaves out wants its min, which it keeps where it is.
- A sharing job the division admits wants exactly its divided size (`Demand.desired`),
  and takes free GPUs before shared ones: when nothing waits, the jobs get what they would
  without sharing.
- A sharing job the division leaves waiting wants its min: it is admitted where its min
  fits beside others (by memory, the jobs per GPU and the utilization cap), and does not
  grow past it until the division gives it GPUs of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from herd_operator.policies.arbitration import divided_sizes
from herd_operator.specs.values import Demand, Placement


@dataclass(frozen=True)
class DivisionOptions:
    """The decision's order (the queue's; None: arrival's or smallest first) and
    `arbitrate`'s options that decide sizes (the allocator's)."""

    order: Mapping[str, tuple[float, ...]] | None = None
    spare_by_gain: bool = False
    share_by_gain: bool = False
    share_by_speedup: bool = False


ARRIVAL_FAIR_SHARE = DivisionOptions()
"""Arrival's order, fair share up to the wishes: `arbitrate`'s without options."""


def follow_division(
    gpus: int,
    ranked: Sequence[Demand],
    current: Mapping[str, Placement],
    frozen: AbstractSet[str],
    options: DivisionOptions,
) -> tuple[list[Demand], frozenset[str]]:
    """The sharing demands (`ranked`, in the decision's order), each wishing for its size in
    the division of `gpus` whole GPUs (its min where the division leaves it waiting), and
    the names of those it admitted (they take free GPUs first): the module docstring's
    rules."""
    # Only the frozen jobs hold theirs: counted from what each holds, a job admitted by
    # sharing would hold a min in the next division and change it (deciding twice differed).
    held = {job: current[job].size for job in frozen if job in current}
    sizes = divided_sizes(
        gpus, ranked, held, frozen=frozen, spare_by_gain=options.spare_by_gain,
        share_by_gain=options.share_by_gain, share_by_speedup=options.share_by_speedup,
    )  # fmt: skip
    sized = [dataclasses.replace(d, desired=sizes[d.name] or d.min) for d in ranked]
    return sized, frozenset(d.name for d in ranked if sizes[d.name] > 0)
