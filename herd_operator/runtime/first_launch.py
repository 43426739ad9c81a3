"""Jobs whose first launch has not formed yet: no decision may resize them.

A worker of a job's first launch waits in the shim until its GPU is bound. If a decision
takes that GPU away before the worker bound, Horovod never tells it (the smaller host set
goes to registered workers only), the others wait for it at the rendezvous until Gloo's
timeout, and the job fails. So a job is frozen from its first grant (or from its adoption
by a restarted operator, which may find a launch still forming) until every GPU of its
grant has a bound worker, its workers report a world size, or `limit_seconds` passed (a
worker that never comes must not freeze its job forever: the lost-worker grace takes its
GPU back after that).

Apart from the allocator because it is one rule over a few jobs' start-up, with its own
clock arithmetic. Not thread-safe by itself: the allocator calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class FirstLaunches:
    """The jobs still forming, each with when its first launch began."""

    def __init__(self, limit_seconds: float) -> None:
        self.limit_seconds = limit_seconds
        self._since: dict[str, float] = {}

    def __contains__(self, job: object) -> bool:
        return job in self._since

    def started(self, job: str, now: float) -> None:
        """`job` got its first GPUs (or was adopted) at `now`; off when the limit is 0."""
        if self.limit_seconds > 0:
            self._since.setdefault(job, now)

    def formed(self, job: str) -> None:
        """`job`'s workers said their world size, or it was released: it is not forming."""
        self._since.pop(job, None)

    def clear(self) -> None:
        self._since.clear()

    def frozen(self, now: float, sizes: Mapping[str, int], bound: Callable[[str], int]) -> set[str]:
        """The jobs still forming at `now`: each holds `sizes[job]` GPUs, `bound(job)` of
        them with a worker. Forgets the jobs that formed, hold nothing or ran out of time."""
        forming = set()
        for job, since in list(self._since.items()):
            size = sizes.get(job, 0)
            if size and now - since < self.limit_seconds and bound(job) < size:
                forming.add(job)
            else:
                del self._since[job]
        return forming

    def next_end(self) -> float | None:
        """When the earliest freeze runs out (None: no job is forming)."""
        return min(self._since.values()) + self.limit_seconds if self._since else None
