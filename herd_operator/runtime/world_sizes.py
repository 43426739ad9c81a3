"""What a job's workers say of their number, and when missing workers count as lost.

Horovod shrinks a job on its own when a worker fails: the job then reports fewer workers
than granted. Fewer workers after more had been seen under the grant (a drop), or for
longer than the grace (a worker that never came: a blacklisted host name must not hold its
GPU forever), means the missing ones are lost, and the allocator takes their GPUs back.

Apart from the allocator's decisions because it is one job's history of reports, not a
decision over every job. Not thread-safe by itself: the allocator calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from herd_operator.specs.values import Slot

LOST_GRACE_SECONDS = 60.0
"""How long a job may report fewer workers than granted, without a drop and without a
worker binding to one of its GPUs, before the missing ones count as lost: a grow normally
completes within seconds."""


def standing(names: Mapping[Slot, str], agents: AbstractSet[str]) -> bool:
    """Whether every granted GPU (`names`: each slot -> the name its worker binds under)
    still has a live agent here (`agents`: the names whose agent runs): then no worker is
    lost, whatever the job reports. A torchrun agent starts its GPU's worker and restarts
    it at each new membership, and the membership forms over many seconds on a loaded
    node: the new agents import torch, each round waits `lastCallSeconds` after its first
    member, and a straggler makes another round, so the world size stays short of the
    grant for longer than the grace, or dips (a round formed without a slow member). A
    worker whose agent runs is coming: the agent either joins or gives up (its join
    timeout, its restarts spent) and exits, and then the slot has none. A Horovod job has
    no agents (`agents` is empty), nor does a GPU on another host (its agent is not seen
    from here): for those, a drop or the grace says what is lost, as before."""
    return bool(names) and all(name in agents for name in names.values())


class WorldSizes:
    """Each job's last reported world size, and since when it has been short of its grant
    without a drop (absent while it is not)."""

    def __init__(self, grace_seconds: float = LOST_GRACE_SECONDS) -> None:
        self.grace_seconds = grace_seconds
        self._world: dict[str, int] = {}
        self._short_since: dict[str, float] = {}

    def __contains__(self, job: object) -> bool:
        """Whether `job`'s workers said anything yet."""
        return job in self._world

    def said(self, job: str, world_size: int) -> int | None:
        """`job`'s workers say they are `world_size`; returns what they said before."""
        previous = self._world.get(job)
        self._world[job] = world_size
        return previous

    def lost(
        self, job: str, previous: int | None, world_size: int, granted: int, now: float
    ) -> bool:
        """Whether `job`'s workers that are missing from its grant of `granted` count as
        lost: a drop below a size seen since the grant last changed (Horovod removed them
        on its own), or a shortfall that lasted `grace_seconds`."""
        if world_size >= granted:
            self._short_since.pop(job, None)
            return False
        since = self._short_since.setdefault(job, now)
        dropped = previous is not None and world_size < previous
        return dropped or now - since >= self.grace_seconds

    def bound(self, job: str, now: float) -> None:
        """A worker of `job` bound to one of its GPUs: a grow still forming is not lost. A
        torchrun grow restarts every worker, and each start binds; the old workers report
        the old size until they are stopped, which on a loaded node or with a large
        snapshot takes longer than the grace. A worker that never comes never binds."""
        if job in self._short_since:
            self._short_since[job] = now

    def regranted(self, job: str, size: int) -> None:
        """`job`'s grant changed to `size`: a size seen before a shrink asked for is no
        reference for a drop (the workers leaving then were told to), and the new grant
        gets its own grace to be filled."""
        if job in self._world:
            self._world[job] = min(self._world[job], size)
        self._short_since.pop(job, None)

    def forget(self, job: str) -> None:
        self._world.pop(job, None)
        self._short_since.pop(job, None)

    def clear(self) -> None:
        self._world.clear()
        self._short_since.clear()
