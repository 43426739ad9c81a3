"""What each job has had of the pool: the history the allocator's queueing reads.

Apart from `allocator.py` because only an allocator with a queue (`policies/queueing.py`)
keeps it: the GPU-seconds each job attained, since when it runs or waits, and how often it
was preempted. The decision itself is `queueing.plan`; this ledger is fed the sizes of each
decision and read at the next one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from herd_operator.policies.queueing import QueueConfig, Service, plan
from herd_operator.specs.values import Demand, Grant, Placement


@dataclass
class _Account:
    service: Service
    size: int
    at: float


class ServiceLedger:
    """Not thread-safe: the allocator calls it under its lock."""

    def __init__(self, config: QueueConfig | None) -> None:
        """`config` None: no queue; the ledger keeps nothing and changes nothing."""
        self.config = config
        self._accounts: dict[str, _Account] = {}

    def queue(
        self,
        demands: Sequence[Demand],
        current: Mapping[str, Placement],
        now: float,
        pool_gpus: int,
        frozen: AbstractSet[str],
    ) -> tuple[
        Sequence[Demand],
        Mapping[str, Placement],
        dict[str, tuple[float, ...]] | None,
        dict[str, str],
    ]:
        """This decision's queue (`queueing.plan`, from the service attained up to `now`):
        the demands and current placements to arbitrate (the preempted jobs left out: they
        get nothing in this decision), the order, and the preempted jobs with why."""
        if self.config is None:
            return demands, current, None, {}
        services: dict[str, Service] = {}
        for demand in demands:
            account = self._accounts.get(demand.name)
            if account is None:
                services[demand.name] = Service(waiting_since=now)
            else:
                attained = account.service.attained + account.size * max(0.0, now - account.at)
                services[demand.name] = replace(account.service, attained=attained)
        sizes = {job: placement.size for job, placement in current.items()}
        queued = plan(demands, sizes, services, self.config, now, pool_gpus, frozen)
        preempted = queued.preempted
        kept = [d for d in demands if d.name not in preempted]
        running = {job: p for job, p in current.items() if job not in preempted}
        return kept, running, queued.order, preempted

    def decided(
        self,
        demands: Mapping[str, Demand],
        grants: Mapping[str, Grant],
        preempted: Mapping[str, str],
        now: float,
    ) -> None:
        """A decision gave `grants` (every job of `demands` has one) and preempted those."""
        if self.config is None:
            return
        for job in demands:
            size = grants[job].placement.size
            account = self._accounts.get(job)
            if account is None:
                account = self._accounts[job] = _Account(Service(waiting_since=now), 0, now)
            service = account.service
            attained = service.attained + account.size * max(0.0, now - account.at)
            if size and not account.size:
                service = Service(attained, running_since=now, preemptions=service.preemptions)
            elif account.size and not size:
                service = Service(attained, waiting_since=now, preemptions=service.preemptions)
            else:
                service = replace(service, attained=attained)
            if job in preempted:
                service = replace(service, preemptions=service.preemptions + 1)
            account.service, account.size, account.at = service, size, now

    def forget(self, job: str) -> None:
        self._accounts.pop(job, None)

    def clear(self) -> None:
        self._accounts.clear()

    def service(self, job: str) -> Service | None:
        account = self._accounts.get(job)
        return account.service if account is not None else None
