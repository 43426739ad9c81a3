"""The operator's own metrics, for Prometheus.

Instruments the operator updates as it works (reconcile durations and errors,
resizes and how long they took), plus a custom collector that reads the jobs'
and the pool's state at scrape time, so a scrape always shows the present.
Names follow Prometheus conventions: `herd_` prefix, base units, `_total` for
counters. The job a series belongs to is the label `herd_job`: Prometheus
itself sets `job` to the scrape job's name.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from herd_operator.controllers.loop import Outcome
from herd_operator.lifecycle import LoopHealth
from herd_operator.runtime.engines import ENGINES
from herd_operator.runtime.store import Store
from herd_operator.specs import ConditionStatus, ConditionType
from herd_operator.specs.conditions import get_condition
from herd_operator.specs.status import MAX_JOB_METRICS, HerdJobStatus, Progress, ResizeCost
from herd_operator.specs.values import Placement, Pool, UsageSample

RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RESIZE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

JOB_STATUSES = (
    "Pending",
    "Running",
    "Resizing",
    "Stalled",
    "Stopped",
    "Suspended",
    "Succeeded",
    "Failed",
    "Unknown",
)
"""The values of `herd_job_status`'s `status` label: a fixed set, so that every job has
the same series (one of them 1), as kube-state-metrics does for a pod's phase. Condition
reasons are not used as label values: their set is open."""
ENDED_STATUSES = frozenset({"Stopped", "Suspended", "Succeeded", "Failed"})
"""A job in one of these has no policy, workers or samples (a suspended one until it is
resumed): its per-job gauges of
those (desired, active, epoch, memory, thresholds) are left out, not kept at their last
value."""


_NOT_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def metric_label(name: str) -> str:
    """A reported metric's name as `herd_job_reported_metric`'s `metric` label: Prometheus'
    rule for names (`[a-zA-Z_][a-zA-Z0-9_]*`), each other character an underscore, so that a
    rule or a dashboard can use it as a metric name ("val/loss" -> "val_loss", "1cycle" ->
    "_1cycle")."""
    label = _NOT_LABEL_CHARS.sub("_", name)
    return label if label and not label[0].isdigit() else f"_{label}"


def job_status(status: HerdJobStatus) -> str:
    """The one of JOB_STATUSES a job is in, from its conditions."""
    word = status.summary()
    if word in JOB_STATUSES:
        return word
    running = get_condition(status.conditions, ConditionType.Running)
    admitted = get_condition(status.conditions, ConditionType.Admitted)
    if admitted is None or admitted.status != ConditionStatus.TRUE:
        return "Pending"
    if running is not None and running.status == ConditionStatus.FALSE:
        # BackOff waits to start the job again; any other reason (Stopped, OperatorStopped,
        # LaunchFailed, ...) says it does not run and is not about to.
        return "Pending" if running.reason == "BackOff" else "Stopped"
    return "Unknown"


class OperatorMetrics:
    """Counters and histograms the operator updates; also the controllers' resize observer,
    and the liveness of the operator's loops (`loops`, which each `Periodic` reports to)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.loops = LoopHealth()
        registry.register(LoopCollector(self.loops))
        self.reconcile_duration = Histogram(
            "herd_reconcile_duration_seconds",
            "Time one reconcile of one job took.",
            buckets=RECONCILE_BUCKETS,
            registry=registry,
        )
        # The one reconcile counter: the errors are its *_error outcomes (a second counter
        # by error kind said the same thing under other names).
        self.reconciles = Counter(
            "herd_reconcile",
            "Reconciles by outcome: success, permanent_error (not retried until the spec "
            "changes), temporary_error (retried with backoff), unexpected_error (a bug, "
            "retried), lost (the store could not commit them; redone).",
            ["outcome"],
            registry=registry,
        )
        self.resizes = Counter(
            "herd_resizes",
            "Grant size changes of running jobs, by direction.",
            ["direction"],
            registry=registry,
        )
        # Known label values start at zero, so dashboards and rate() see them from the start.
        for outcome in Outcome:
            self.reconciles.labels(outcome=outcome.value)
        for direction in ("grow", "shrink"):
            self.resizes.labels(direction=direction)
        self.resize_duration = Histogram(
            "herd_resize_duration_seconds",
            "From a grant change to the workers reporting the new world size, by the job's"
            " engine and the resize's direction (unknown: the size before was not known).",
            ["engine", "direction"],
            buckets=RESIZE_BUCKETS,
            registry=registry,
        )
        for engine in ENGINES:
            for direction in ("grow", "shrink"):
                self.resize_duration.labels(engine=engine, direction=direction)

    # LoopObserver (controllers.loop)
    def reconciled(self, outcome: Outcome, seconds: float) -> None:
        self.reconciles.labels(outcome=outcome.value).inc()
        if outcome is Outcome.LOST:
            return  # its writes were lost and it is redone (if it ran at all): no duration
        self.reconcile_duration.observe(seconds)

    # ReconcileObserver (controllers.ports)
    def resized(self, job: str, before: int, after: int) -> None:
        self.resizes.labels(direction="grow" if after > before else "shrink").inc()

    def resize_completed(self, job: str, cost: ResizeCost) -> None:
        self.resize_duration.labels(engine=cost.engine, direction=cost.direction).observe(
            cost.seconds
        )


class LoopCollector(Collector):
    """Whether each of the operator's loops runs, its failed steps and its last success."""

    def __init__(self, health: LoopHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "herd_loop_up",
            "1 while the loop's thread runs; 0 once it died (an error that ended it, said in"
            " the log) or stopped.",
            labels=["loop"],
        )
        errors = CounterMetricFamily(
            "herd_loop_errors",
            "Steps of the loop that failed (each logged, the first of a run with its"
            " traceback, then at most once a minute; the loop backs off and goes on).",
            labels=["loop"],
        )
        success = GaugeMetricFamily(
            "herd_loop_last_success_timestamp_seconds",
            "When a step of the loop last succeeded (Unix time).",
            labels=["loop"],
        )
        for name, state in sorted(self.health.snapshot().items()):
            up.add_metric([name], 1 if state.running else 0)
            errors.add_metric([name], state.errors)
            if state.last_success is not None:
                success.add_metric([name], state.last_success)
        yield from (up, errors, success)


class StateCollector(Collector):
    """Jobs, GPUs per job and the pool, read from the store and the allocator at scrape time."""

    def __init__(
        self,
        store: Store,
        pool: Callable[[], Pool],
        placements: Callable[[], Mapping[str, Placement]],
        request_counts: Callable[[], Mapping[tuple[str, str], int]],
        overdue_drains: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.store = store
        self.pool = pool
        self.placements = placements
        self.request_counts = request_counts
        self.overdue_drains = overdue_drains

    def collect(self) -> Iterator[Metric]:
        series = _JobSeries(self.clock())
        latest_usage = self.store.latest_usage()
        placements = self.placements()
        holding = {job for job, placement in placements.items() if placement.size}
        policies = self.store.job_policies()  # the specs' policies, without parsing them
        for record in self.store.list_jobs():
            series.add(
                record.name,
                record.status,
                # A sample describes the GPUs the job held then: only shown while it holds some.
                latest_usage.get(record.name) if record.name in holding else None,
                policies.get(record.name, ("", {})),
            )
        yield from series.families()
        yield GaugeMetricFamily(
            "herd_store_writable",
            "1 while the state store takes writes; 0 from a write the storage refused (a full"
            " disk) until one works again. The jobs keep running meanwhile.",
            value=1 if self.store.writable else 0,
        )

        held = sum(placement.size for placement in placements.values())
        pool = GaugeMetricFamily("herd_pool_gpus", "GPUs of the pool by state.", labels=["state"])
        pool.add_metric(["allocated"], held)
        pool.add_metric(["free"], self.pool().size - held)
        yield pool
        overdue = GaugeMetricFamily(
            "herd_drains_overdue",
            "GPUs given back by a job whose workers have not been seen to leave them within"
            " the drain time; held until they are.",
        )
        overdue.add_metric([], self.overdue_drains())
        yield overdue

        requests = CounterMetricFamily(
            "herd_allocator_requests",
            "Requests to the allocator's RPC server, by operation and result.",
            labels=["op", "result"],
        )
        for (op, result), count in sorted(self.request_counts().items()):
            requests.add_metric([op, result], count)
        yield requests


class _JobSeries:
    """The per-job families of one scrape, and the count of jobs by condition."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.progress = _ProgressSeries()
        self.jobs = GaugeMetricFamily(
            "herd_jobs", "Jobs by condition and its status.", labels=["condition", "status"]
        )
        self.desired = GaugeMetricFamily(
            "herd_job_gpus_desired", "GPUs the job's policy asks for.", labels=["herd_job"]
        )
        self.allocated = GaugeMetricFamily(
            "herd_job_gpus_allocated", "GPUs the allocator granted the job.", labels=["herd_job"]
        )
        self.active = GaugeMetricFamily(
            "herd_job_gpus_active",
            "World size the job's workers last reported.",
            labels=["herd_job"],
        )
        self.epoch = GaugeMetricFamily(
            "herd_job_epoch", "Last epoch the workers reported.", labels=["herd_job"]
        )
        self.memory = GaugeMetricFamily(
            "herd_job_memory_utilization_ratio",
            "Used over total memory of the job's GPUs at the last sample.",
            labels=["herd_job"],
        )
        self.thresholds = GaugeMetricFamily(
            "herd_job_policy_threshold_ratio",
            "The memory policy's thresholds for the job.",
            labels=["herd_job", "bound"],
        )
        self.job_statuses = GaugeMetricFamily(
            "herd_job_status",
            "1 for the status the job is in, 0 for the others (one series per status).",
            labels=["herd_job", "status"],
        )
        self.restarts = CounterMetricFamily(
            "herd_job_restarts",
            "Times the operator started the job again after it failed (restartPolicy).",
            labels=["herd_job"],
        )
        self.last_resize = GaugeMetricFamily(
            "herd_job_last_resize_seconds",
            "What the job's last finished resize cost: from the grant change to the workers"
            " reporting the new world size; mode: live (no worker restarted) or restart"
            " (every worker restarted), as the job's engine resizes.",
            labels=["herd_job", "engine", "mode"],
        )
        self.counts: dict[tuple[str, str], int] = {
            (str(t), s): 0 for t in ConditionType for s in ("True", "False", "Unknown")
        }

    def add(
        self,
        name: str,
        status: HerdJobStatus,
        sample: UsageSample | None,
        policy: tuple[str, dict[str, object]],
    ) -> None:
        """One job's series; ``sample``: its last usage, while it holds GPUs."""
        for condition in status.conditions:
            key = (condition.type, str(condition.status))
            self.counts[key] = self.counts.get(key, 0) + 1
        now_in = job_status(status)
        for value in JOB_STATUSES:
            self.job_statuses.add_metric([name, value], 1 if value == now_in else 0)
        self.restarts.add_metric([name], status.restarts)
        cost = status.last_resize
        if cost is not None:  # a past cost: shown for an ended job too, as its restarts
            mode = cost.mode.value if cost.mode is not None else "unknown"
            self.last_resize.add_metric([name, cost.engine, mode], cost.seconds)
        if status.gpus is not None:
            self.allocated.add_metric([name], status.gpus.allocated)
        if now_in in ENDED_STATUSES:
            return  # no policy asks, no worker reports: nothing else is current
        if status.gpus is not None:
            if status.gpus.desired is not None:
                self.desired.add_metric([name], status.gpus.desired)
            if status.gpus.active is not None:
                self.active.add_metric([name], status.gpus.active)
        if status.epoch is not None:
            self.epoch.add_metric([name], status.epoch)
        self.progress.add(name, status, self.now, running=now_in in ("Running", "Resizing"))
        if sample is not None and sample.total_bytes:
            self.memory.add_metric([name], sample.used_bytes / sample.total_bytes)
        policy_name, params = policy
        if policy_name == "memory":
            for bound, default in (("low", 0.25), ("high", 0.75)):
                threshold = params.get(bound, default)
                if isinstance(threshold, int | float):
                    self.thresholds.add_metric([name, bound], float(threshold))

    def families(self) -> Iterator[Metric]:
        for (condition_type, condition_status), count in sorted(self.counts.items()):
            self.jobs.add_metric([condition_type, condition_status], count)
        yield from (self.jobs, self.job_statuses, self.restarts, self.desired, self.allocated)
        yield self.last_resize
        yield from (self.active, self.epoch, self.memory, self.thresholds)
        yield from self.progress.families()


class _ProgressSeries:
    """A running job's progress against its expected epochs, its ETA, and the metrics its
    workers last reported (`report_epoch`): what `describe` shows, per job."""

    def __init__(self) -> None:
        self.expected = GaugeMetricFamily(
            "herd_job_expected_epochs",
            "Epochs the job's spec expects (spec.training.epochs).",
            labels=["herd_job"],
        )
        self.ratio = GaugeMetricFamily(
            "herd_job_progress_ratio",
            "Epochs done over the epochs expected (at most 1).",
            labels=["herd_job"],
        )
        self.epoch_time = GaugeMetricFamily(
            "herd_job_epoch_duration_seconds",
            "One epoch's time at the job's current world size: the median of its last"
            " epochs measured whole at that size.",
            labels=["herd_job"],
        )
        self.eta = GaugeMetricFamily(
            "herd_job_eta_seconds",
            "Time until the expected epochs are done, estimated from the epoch time at the"
            " current size (absent until an epoch is measured at that size).",
            labels=["herd_job"],
        )
        self.reported = GaugeMetricFamily(
            "herd_job_reported_metric",
            "The last value of each metric the job's workers report with an epoch end"
            f" (report_epoch), at most {MAX_JOB_METRICS} names per job; `metric` is the"
            " name with characters outside [a-zA-Z0-9_] made underscores.",
            labels=["herd_job", "metric"],
        )

    def add(self, name: str, status: HerdJobStatus, now: float, *, running: bool) -> None:
        """``running``: the job runs now; a pending one (back in the queue after a lost
        node, say) shows its progress but no epoch time or ETA, which were its last run's."""
        progress: Progress | None = status.progress
        if progress is not None:
            self.expected.add_metric([name], progress.epochs)
            self.ratio.add_metric([name], min(1.0, progress.completed / progress.epochs))
        if progress is not None and running:
            if progress.epoch_seconds is not None:
                self.epoch_time.add_metric([name], progress.epoch_seconds)
            if progress.estimated_completion is not None:
                self.eta.add_metric([name], max(0.0, progress.estimated_completion - now))
        labels: set[str] = set()
        for metric, value in list(status.metrics.items())[:MAX_JOB_METRICS]:
            label = metric_label(metric)
            if label not in labels:  # two names made one: the first reported is shown
                labels.add(label)
                self.reported.add_metric([name, label], value)

    def families(self) -> Iterator[Metric]:
        yield from (self.expected, self.ratio, self.epoch_time, self.eta, self.reported)
