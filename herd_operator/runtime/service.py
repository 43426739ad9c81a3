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
from herd_operator.specs.values import Demand, Grant, Placement, ServiceRecord

ServiceRecords = Mapping[str, ServiceRecord]
"""Job -> its service as recorded (`ServiceLedger.records`, `restore`)."""


@dataclass
class _Account:
    service: Service
    size: int
    at: float
    preempted: str = ""
    """Why its latest preemption took its GPUs, until it is granted some again."""


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
        grants: dict[str, Grant],
        preempted: Mapping[str, str],
        now: float,
    ) -> None:
        """A decision gave `grants` (every job of `demands` has one) and preempted those.

        A job preempted earlier and granted nothing again keeps its preemption's reason
        (changed in `grants`): the controller stops its workers on it (`is_preemption`), and
        a decision made before its reconcile must not hide it."""
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
                account.preempted = preempted[job]
            elif size:
                account.preempted = ""
            elif account.preempted:
                grants[job] = Grant(Placement.EMPTY, account.preempted)
            account.service, account.size, account.at = service, size, now

    def records(self, now: float, wall: float) -> dict[str, ServiceRecord]:
        """Every job's service as of `now` (this ledger's clock), in wall-clock times
        (`wall` is `now` on the wall clock), for the store."""

        def on_wall(at: float | None) -> float | None:
            return None if at is None else wall - (now - at)

        return {
            job: ServiceRecord(
                attained=account.service.attained + account.size * max(0.0, now - account.at),
                at=wall,
                size=account.size,
                running_since=on_wall(account.service.running_since),
                waiting_since=on_wall(account.service.waiting_since),
                preemptions=account.service.preemptions,
                preempted=account.preempted,
            )
            for job, account in self._accounts.items()
        }

    def restore(self, records: ServiceRecords, now: float, wall: float) -> None:
        """Take back what a previous operator recorded (`records`). A job that held GPUs
        then attained them on while no operator ran (its workers ran on): the time since
        the record counts at the size recorded."""
        if self.config is None:
            return

        def on_clock(at: float | None) -> float | None:
            return None if at is None else now - max(0.0, wall - at)

        for job, record in records.items():
            attained = record.attained + record.size * max(0.0, wall - record.at)
            service = Service(
                attained, on_clock(record.running_since), on_clock(record.waiting_since),
                record.preemptions,
            )  # fmt: skip
            self._accounts[job] = _Account(service, record.size, now, record.preempted)

    def forget(self, job: str) -> None:
        self._accounts.pop(job, None)

    def clear(self) -> None:
        self._accounts.clear()

    def service(self, job: str) -> Service | None:
        account = self._accounts.get(job)
        return account.service if account is not None else None
