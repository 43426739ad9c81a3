"""The discrete-event simulation: a virtual clock driving the operator's real decisions.

Nothing here decides who gets a GPU. Each job's wish comes from the real policy
(`herd_operator.policies.registry.load_policy`), called with what the operator would observe (epoch
reports, GPU memory samples, its grant and last resize); the grants come from the real
`Allocator` (gang admission, priorities, fair share, shrink-to-admit, the resize rate limit
and drains, through `arbitrate()`), run on the simulation's clock. What the simulation adds is
the jobs: their progress on the GPUs they hold (`JobModel`), the stall of each resize, and
when they report (epoch ends, and with adaptive batch a measurement `measure_steps` steps into
each new size or batch).

Events that fall on the same instant (or, with `tick` > 0, in the same tick: the control
loop's period) are handled in one `Allocator.batch()`, as the operator's loop handles a
burst of reconciles under one decision. A job whose grant a decision changed is reconciled
again at the same instant, as the allocator's wake-up does in the operator.
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from herd_operator.policies.base import JobObservations, Policy, Signal
from herd_operator.policies.registry import load_policy
from herd_operator.runtime.allocator import Allocator
from herd_operator.simulate.colocation import GpuOccupancy, sharing_request
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.model import GPU_MEMORY_BYTES, JobModel
from herd_operator.simulate.results import JobOutcome, SimResult, Step
from herd_operator.specs import HerdJob
from herd_operator.specs.values import Demand, Grant, Placement, Report, UsageSample

_NO_METRICS: Mapping[str, float] = MappingProxyType({})
KEPT_OBSERVATIONS = 16
"""Epoch reports and memory samples kept per job: every built-in policy reads the latest few."""


class Kind(enum.IntEnum):
    ARRIVAL = 0
    SETTLED = 1
    """A resize's stall is over: the workers report their world size (frees drains)."""
    EPOCH = 2
    RECONCILE = 3
    WAKE = 4
    """A recently resized job may be resized again: decide again."""
    RESYNC = 5
    """The operator's periodic resync: every running job is reconciled again."""
    MEASURE = 6
    """The workers report their measurement a few steps into a new configuration."""


class _NullSink:
    """Placements reach nobody: the jobs are simulated."""

    def publish(self, job: str, placement: Placement) -> None:
        pass

    def withdraw(self, job: str) -> None:
        pass


@dataclass
class _Run:
    model: JobModel
    spec: HerdJob
    placement: Placement = Placement.EMPTY
    size: int = 0
    wanted: int = 0
    done: float = 0.0
    last_update: float = 0.0
    stall_until: float = 0.0
    epoch: int = 0
    version: int = 0
    admitted: float | None = None
    finished: float | None = None
    last_resize: float | None = None
    resizes: int = 0
    preemptions: int = 0
    gpu_seconds: float = 0.0
    memory_seconds: float = 0.0
    """GPU-seconds weighted by the share of memory used."""
    slowdown: float = 1.0
    """Its neighbours' interference now (`pack`): progress is divided by it."""
    max_slowdown: float = 1.0
    working_seconds: float = 0.0
    lost_seconds: float = 0.0
    """Of its working time, the part its neighbours took (`pack`)."""
    batch: int | None = None
    """The global batch it trains at; None: its trace's."""
    reports: list[Report] = field(default_factory=list)
    """Its epoch ends and measurements, oldest first."""
    usage: list[UsageSample] = field(default_factory=list)


@dataclass(slots=True)
class _Tally:
    """What a run counts as it goes, and the GPUs allocated and their memory used now."""

    events: int = 0
    batches: int = 0
    policy_calls: int = 0
    decide_seconds: float = 0.0
    policy_seconds: float = 0.0
    allocated: int = 0
    memory: float = 0.0
    """GPUs' worth of memory used."""


class Simulation:
    def __init__(self, jobs: Sequence[JobModel], config: SimConfig) -> None:
        names = [job.name for job in jobs]
        if len(set(names)) != len(names):
            raise ValueError("two jobs of the workload share a name")
        too_big = [job.name for job in jobs if job.min_gpus > config.pool.size]
        if too_big:
            raise ValueError(f"min above the pool's {config.pool.size} GPUs: {too_big[:3]}")
        self.config = config
        self.jobs = list(jobs)
        self._by_name = {job.name: job for job in jobs}
        self.now = 0.0
        self.policy: Policy = load_policy(config.policy)
        self._observes = self.policy.observes
        self._measures = config.adaptive_batch and config.measure_steps > 0
        self._gpus_per_node = max((len(gpus) for _, gpus in config.pool.hosts), default=0) or None
        self._heap: list[tuple[float, int, Kind, str, int]] = []
        self._seq = 0
        self._runs: dict[str, _Run] = {}
        self._active: dict[str, None] = {}
        self._unsettled: set[str] = set()
        """Admitted jobs below what they want, and pending jobs: a thaw may help them."""
        self._changed: dict[str, Grant] = {}
        self._decisions = 0
        self._steps: list[Step] = []
        self._wake_at: float | None = None
        self._specs: dict[tuple[int, ...], HerdJob] = {}
        self._occupancy = GpuOccupancy() if config.pack else None
        self.allocator = Allocator(
            config.pool,
            _NullSink(),
            virtual=True,
            on_decision=self._count_decision,
            min_resize_interval=config.min_resize_interval,
            drain_seconds=config.drain_seconds,
            clock=lambda: self.now,
            spare_by_gain=config.spare_by_gain,
            smallest_first=config.smallest_first,
            share_by_gain=config.share_by_gain,
            share_by_speedup=config.share_by_speedup,
            max_wait_seconds=config.max_wait_seconds,
            queue=config.queue,
            sharing=config.sharing if config.pack else None,
        )
        self.allocator.watch(self._on_change)

    def _count_decision(self, placements: object) -> None:
        self._decisions += 1

    def _on_change(self, job: str, grant: Grant) -> None:
        self._changed[job] = grant

    def _spec(self, model: JobModel) -> HerdJob:
        """The spec a policy sees; policies read only its GPU range, priority, policy and,
        with adaptive batch, its max batch and the most samples a GPU computes at once (its
        step model's largest local batch: past it the step is micro-batched)."""
        adaptive = self.config.adaptive_batch and model.batching is not None
        max_batch = model.batching.max_batch if adaptive and model.batching else 0
        worker = model.batching.max_worker_batch() if adaptive and model.batching else 0
        key = (model.min_gpus, model.max_gpus, model.priority, max_batch, worker)
        spec = self._specs.get(key)
        if spec is None:
            body: dict[str, object] = {
                "command": ["train"],
                "gpus": {"min": model.min_gpus, "max": model.max_gpus},
                "priority": model.priority,
                "policy": self.config.policy.model_dump(),
            }
            if max_batch:
                body["training"] = {
                    "batchPolicy": "adaptive",
                    "maxBatch": max_batch,
                    "maxWorkerBatch": worker,
                    "measureSteps": self.config.measure_steps,
                }
            spec = self._specs[key] = HerdJob.model_validate(
                {
                    "apiVersion": "herd/v1alpha1",
                    "kind": "HerdJob",
                    "metadata": {"name": "simulated"},
                    "spec": body,
                }
            )
        return spec

    def _push(self, at: float, kind: Kind, name: str, version: int = 0) -> None:
        if at < self.now:
            raise RuntimeError(f"event {kind.name} for {name} at {at} before now {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, name, version))

    def run(self) -> SimResult:
        started = time.perf_counter()
        for job in self.jobs:
            self._push(job.arrival, Kind.ARRIVAL, job.name)
        if self.config.resync > 0 and self.jobs:
            self._push(min(job.arrival for job in self.jobs), Kind.RESYNC, "")
        tick = self.config.tick
        tally = _Tally()
        timeline: list[tuple[float, int, float]] = []
        recorded: list[tuple[float, list[Step], dict[str, Placement]]] = []
        while self._heap:
            first = self._heap[0][0]
            # Never before the first event (float rounding of first / tick * tick could put
            # it a hair before, and then no event would ever be due: a livelock).
            at = first if tick <= 0 else max(math.ceil(first / tick) * tick, first)
            self.now = max(at, self.now)
            tally.batches += 1
            next_resync = self._decide(tally)
            self._apply_changes(tally)
            allocated = tally.allocated if self._occupancy is None else self._occupancy.occupied
            timeline.append((self.now, allocated, tally.memory))
            if self.config.record:
                recorded.append((self.now, self._steps, self.allocator.placements()))
                self._steps = []
            self._schedule_wake()
            if next_resync is not None and self._heap:
                # Only while something else will happen: a resync alone changes nothing.
                self._push(max(next_resync, self.now), Kind.RESYNC, "")
        return SimResult(
            policy=self.config.policy.name,
            pool_gpus=self.config.pool.size,
            jobs=self._outcomes(),
            timeline=timeline,
            decisions=self._decisions,
            batches=tally.batches,
            events=tally.events,
            policy_calls=tally.policy_calls,
            wall_seconds=time.perf_counter() - started,
            decide_seconds=tally.decide_seconds,
            policy_seconds=tally.policy_seconds,
            unfinished=sorted(name for name in self._active),
            steps=recorded,
        )

    def _decide(self, tally: _Tally) -> float | None:
        """The events due now handled and their jobs reconciled, under one allocator decision;
        returns when the next resync is due if one was handled."""
        touched: dict[str, None] = {}
        batch = self.allocator.batch()
        batch.__enter__()
        try:
            wake, next_resync = self._handle_due(touched, tally)
            clock = time.perf_counter()
            for name in touched:
                run = self._runs[name]
                if run.finished is None:
                    self._reconcile(run)
                    tally.policy_calls += 1
            if wake and self._active:
                # The operator's resync requests again; a request after a thaw decides.
                self._reconcile(self._runs[next(iter(self._active))])
                tally.policy_calls += 1
            tally.policy_seconds += time.perf_counter() - clock
        finally:
            clock = time.perf_counter()
            batch.__exit__(None, None, None)
            tally.decide_seconds += time.perf_counter() - clock
        return next_resync

    def _handle_due(self, touched: dict[str, None], tally: _Tally) -> tuple[bool, float | None]:
        """Pop the events due by now; the jobs to reconcile go into `touched`. Returns whether
        a wake-up was due, and when the next resync is if one was."""
        wake = False
        next_resync: float | None = None
        while self._heap and self._heap[0][0] <= self.now:
            when, _, kind, name, version = heapq.heappop(self._heap)
            tally.events += 1
            run = self._runs.get(name)
            if kind is Kind.ARRIVAL:
                model = self._by_name[name]
                run = self._runs[name] = _Run(model, self._spec(model))
                run.last_update = self.now
                self._active[name] = None
                touched[name] = None
            elif kind is Kind.WAKE:
                wake = True
                self._wake_at = None
            elif kind is Kind.RESYNC:
                touched.update(dict.fromkeys(self._active))
                next_resync = when + self.config.resync
            elif run is None or run.finished is not None or version != run.version:
                continue  # superseded by a later grant change
            elif kind is Kind.EPOCH:
                if self._epoch(run, when):
                    tally.allocated -= run.size
                    tally.memory -= run.size * run.model.memory_fraction(run.size)
                    self._finish(run, when)
                else:
                    touched[name] = None
            elif kind is Kind.MEASURE:
                self._measure(run, when)
                touched[name] = None
            elif kind is Kind.SETTLED:
                self._record(("world", name, run.size))
                self.allocator.observe_world_size(name, run.size)
            else:
                touched[name] = None
        return wake, next_resync

    def _apply_changes(self, tally: _Tally) -> None:
        """The grants the last decision changed, applied to their jobs."""
        changes, self._changed = self._changed, {}
        neighbours: set[str] = set()
        for name, grant in changes.items():
            run = self._runs[name]
            if run.finished is not None or grant.placement == run.placement:
                continue
            old = run.size
            self._apply(run, grant.placement)
            if self._occupancy is not None:
                slots = grant.placement.slots()
                neighbours |= self._occupancy.place(name, slots, run.model.gpu_utilization)
            tally.allocated += run.size - old
            tally.memory += run.size * run.model.memory_fraction(run.size) - old * (
                run.model.memory_fraction(old)
            )
            self._push(self.now, Kind.RECONCILE, name, run.version)
        self._interfere(neighbours)

    def _interfere(self, names: set[str]) -> None:
        """The jobs whose GPUs' neighbours changed run from now at their new slowdown."""
        if self._occupancy is None:
            return
        for name in names:
            run = self._runs[name]
            if run.finished is not None or run.size == 0:
                continue
            slowdown = self._occupancy.slowdown(name)
            if slowdown != run.slowdown:
                self._advance(run, self.now)
                run.slowdown = slowdown
                run.max_slowdown = max(run.max_slowdown, slowdown)
                self._schedule_epoch(run)

    def _outcomes(self) -> list[JobOutcome]:
        return [
            JobOutcome(
                run.model.name,
                run.model.arrival,
                run.admitted or 0.0,
                run.finished or 0.0,
                run.model.requested,
                run.gpu_seconds,
                run.memory_seconds,
                run.resizes,
                run.preemptions,
                run.max_slowdown,
                run.working_seconds / (run.working_seconds - run.lost_seconds)
                if run.lost_seconds
                else 1.0,
            )
            for run in self._runs.values()
            if run.finished is not None
        ]

    def _record(self, step: Step) -> None:
        if self.config.record:
            self._steps.append(step)

    def _reconcile(self, run: _Run) -> None:
        """What the reconciler does for a job: observe, ask the policy, ask the allocator."""
        model = run.model
        started = run.admitted if run.admitted is not None else model.arrival
        epochs: Sequence[Report] = run.reports if Signal.EPOCHS in self._observes else ()
        measurements: Sequence[Report] = ()
        if self._measures and any(report.measurement for report in epochs):
            measurements = [report for report in epochs if report.measurement]
            epochs = [report for report in epochs if not report.measurement]
        observed = JobObservations(
            started_at=started,
            allocated=run.size,
            world_size=run.size or None,
            last_resize=run.last_resize,
            epochs=epochs,
            usage=run.usage if Signal.USAGE in self._observes else (),
            gpus_per_node=self._gpus_per_node,
            measurements=measurements,
        )
        decision = self.policy.desired(run.spec, observed, self.now)
        if self.config.adaptive_batch and model.batching is not None:
            self._rebatch(run, model.batching.clamp(decision.batch_size))
        run.wanted = max(model.min_gpus, min(model.max_gpus, decision.gpus))
        self._settle(run)
        demand = Demand(
            model.name, model.min_gpus, model.max_gpus, decision.gpus, model.priority,
            model.arrival, decision.gains, run.epoch / model.epochs,
            *sharing_request(model, self.config.pack, self.config.share_utilization),
            resumable=model.resumable,
            min_speedup=decision.min_speedup,
        )  # fmt: skip
        self._record(("request", demand))
        self.allocator.request(demand)

    def _rebatch(self, run: _Run, wanted: int) -> None:
        """The job trains at `wanted` from now (on its GPUs: `BatchModel.batch_on`)."""
        if wanted == run.batch:
            return
        if run.size > 0:
            self._advance(run, self.now)  # the progress so far at the old batch
        run.batch = wanted
        if run.size > 0:
            self._schedule_epoch(run, measure=True)

    def _rate(self, run: _Run) -> float:
        """Work per second at its size and batch."""
        if run.batch is None:
            return run.model.speedup(run.size)
        return run.model.rate(run.size, run.batch, run.epoch / run.model.epochs)

    def _settle(self, run: _Run) -> None:
        if run.finished is None and run.size != run.wanted:
            self._unsettled.add(run.model.name)
        else:
            self._unsettled.discard(run.model.name)

    def _advance(self, run: _Run, until: float) -> None:
        """Progress and GPU-seconds of `run` up to `until`."""
        if run.size > 0:
            working_from = max(run.last_update, run.stall_until)
            if until > working_from:
                working = until - working_from
                run.done += self._rate(run) * working / run.slowdown
                if run.slowdown > 1.0:
                    run.working_seconds += working
                    run.lost_seconds += working * (1.0 - 1.0 / run.slowdown)
                elif self.config.pack:
                    run.working_seconds += working
            spent = until - run.last_update
            run.gpu_seconds += run.size * spent
            run.memory_seconds += run.size * run.model.memory_fraction(run.size) * spent
        run.last_update = until

    def _apply(self, run: _Run, placement: Placement) -> None:
        """The job's grant changed at `now`."""
        self._advance(run, self.now)
        old, new = run.size, placement.size
        run.placement = placement
        if old == new == 0:
            return
        # Same size elsewhere (a shared GPU's worker moved): a new worker joins, as a grow by
        # one does, and the job then reports its size (frees the drain of the GPU it left).
        stall = run.model.stall(old - 1 if old == new else old, new)
        if old == 0 and run.admitted is None:
            run.admitted = self.now
        elif old > 0 and new == 0:
            # Preempted: it starts again from its last checkpoint, the end of its last epoch.
            run.done = run.epoch * run.model.epoch_work()
            run.preemptions += 1
        elif old > 0 and new > 0:
            run.resizes += 1
            run.last_resize = self.now
        run.size = new
        run.stall_until = self.now + stall
        self._settle(run)
        self._schedule_epoch(run, measure=True)
        if new == 0 and old > 0:
            # Its workers stop at once and say so: the GPUs they drained are free.
            self._push(self.now, Kind.SETTLED, run.model.name, run.version)

    def _schedule_epoch(self, run: _Run, measure: bool = False) -> None:
        """The job's next epoch end (and its settling) at its rate now; with `measure`, its
        workers' report `measure_steps` steps into this configuration if sooner."""
        run.version += 1
        if run.size == 0:
            return
        working_from = max(self.now, run.stall_until)
        left = max((run.epoch + 1) * run.model.epoch_work() - run.done, 0.0)
        rate = self._rate(run) / run.slowdown
        epoch_end = working_from + left / rate
        self._push(epoch_end, Kind.EPOCH, run.model.name, run.version)
        batching = run.model.batching
        if measure and self._measures and batching is not None:
            batch = batching.clamp(run.batch)
            steps = self.config.measure_steps * batching.step_seconds(run.size, batch)
            if working_from + steps * run.slowdown < epoch_end:
                self._push(working_from + steps * run.slowdown, Kind.MEASURE,
                           run.model.name, run.version)  # fmt: skip
        if run.stall_until > self.now:
            self._push(run.stall_until, Kind.SETTLED, run.model.name, run.version)

    def _epoch(self, run: _Run, when: float) -> bool:
        """An epoch ended at `when`: the workers report; True if it was the last."""
        self._advance(run, when)
        run.epoch += 1
        run.done = max(run.done, run.epoch * run.model.epoch_work())
        # Only what the policy reads is kept (a million epoch ends in a 100,000-job run).
        if Signal.EPOCHS in self._observes:
            run.reports.append(Report(run.epoch - 1, when, run.size, self._metrics(run)))
            del run.reports[:-KEPT_OBSERVATIONS]
        if Signal.USAGE in self._observes:
            total = run.size * GPU_MEMORY_BYTES
            used = int(total * run.model.memory_fraction(run.size))
            run.usage.append(UsageSample(when, run.size, used, total))
            del run.usage[:-KEPT_OBSERVATIONS]
        if run.epoch >= run.model.epochs:
            return True
        self._schedule_epoch(run)
        return False

    def _measure(self, run: _Run, when: float) -> None:
        """The workers' report a few steps into the configuration: the epoch's metrics so
        far, no epoch end."""
        if Signal.EPOCHS in self._observes:
            run.reports.append(Report(None, when, run.size, self._metrics(run), measurement=True))
            del run.reports[:-KEPT_OBSERVATIONS]

    def _metrics(self, run: _Run) -> Mapping[str, float]:
        """What its workers attach to an epoch end: with adaptive batch, the adaptive metrics
        (the noise scale of the epoch it starts)."""
        batching = run.model.batching
        if not self.config.adaptive_batch or batching is None or run.size <= 0:
            return _NO_METRICS
        return batching.metrics(run.size, run.batch, run.epoch / run.model.epochs)

    def _finish(self, run: _Run, when: float) -> None:
        run.finished = when
        run.size = 0
        run.placement = Placement.EMPTY
        run.version += 1
        del self._active[run.model.name]
        self._unsettled.discard(run.model.name)
        self._record(("release", run.model.name, 0))
        self.allocator.release(run.model.name)
        if self._occupancy is not None:
            self._interfere(self._occupancy.place(run.model.name, (), 0.0))

    def _schedule_wake(self) -> None:
        """Wake when the allocator thaws a job, if a thaw can change anything."""
        thaw = self.allocator.thaw_at()
        if thaw is None or not self._unsettled or thaw <= self.now:
            return
        if self._wake_at is not None and self._wake_at <= thaw:
            return
        self._wake_at = thaw
        self._push(thaw, Kind.WAKE, "")
