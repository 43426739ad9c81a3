"""Plain value types that every layer shares: the pool, placements, demands and grants,
and what is observed of a running job (worker reports, GPU memory samples).

One definition each. They import nothing of ours, so `specs`, `policies`,
`controllers`, the runtime and the exporters can all speak them. Decisions on them
live elsewhere (`herd_operator.policies.arbitration`, the policies).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import ClassVar

Slot = tuple[str, int]
HostGpus = tuple[tuple[str, tuple[int, ...]], ...]
JsonPlacement = list[list[str | list[int]]]


def _check_hosts(hosts: HostGpus, what: str) -> None:
    seen: set[str] = set()
    for host, gpus in hosts:
        if host in seen:
            raise ValueError(f"{what}: host {host!r} is listed twice")
        seen.add(host)
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"{what}: host {host!r} lists a GPU twice: {list(gpus)}")
        if any(gpu < 0 for gpu in gpus):
            raise ValueError(f"{what}: host {host!r} has a negative GPU index: {list(gpus)}")


@dataclass(frozen=True)
class Pool:
    """The GPUs the allocator owns; host order is the order of `--hosts`."""

    hosts: HostGpus
    gpu_memory_bytes: int | None = None
    """Memory of each GPU (the pool's GPUs are taken to be alike), when known: what jobs
    that share GPUs (`Demand.share`) are packed into. None: no GPU is shared."""

    def __post_init__(self) -> None:
        _check_hosts(self.hosts, "pool")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 1:
            raise ValueError(f"pool: gpu_memory_bytes must be >= 1, got {self.gpu_memory_bytes}")

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], gpu_memory_bytes: int | None = None) -> Pool:
        """A pool with GPUs 0..n-1 on each host, hosts in the mapping's order."""
        for host, count in counts.items():
            if count < 0:
                raise ValueError(f"pool: host {host!r} has a negative GPU count: {count}")
        hosts = tuple((host, tuple(range(count))) for host, count in counts.items())
        return cls(hosts, gpu_memory_bytes)

    # Cached: a pool is immutable and every decision reads these (7,168 slots on 1,792 nodes).
    @cached_property
    def size(self) -> int:
        return sum(len(gpus) for _, gpus in self.hosts)

    def slots(self) -> tuple[Slot, ...]:
        return self._slots

    @cached_property
    def _slots(self) -> tuple[Slot, ...]:
        return tuple((host, gpu) for host, gpus in self.hosts for gpu in gpus)

    @cached_property
    def slot_set(self) -> frozenset[Slot]:
        return frozenset(self._slots)

    @cached_property
    def host_positions(self) -> dict[str, int]:
        """Each host's position in `hosts`."""
        return {host: position for position, (host, _) in enumerate(self.hosts)}

    @cached_property
    def positions_by_gpu_count(self) -> dict[int, tuple[int, ...]]:
        """Each GPU count -> the positions (in `hosts`) of the hosts with that many GPUs."""
        by_count: dict[int, list[int]] = {}
        for position, (_, gpus) in enumerate(self.hosts):
            by_count.setdefault(len(gpus), []).append(position)
        return {count: tuple(positions) for count, positions in by_count.items()}

    @cached_property
    def sorted_hosts(self) -> HostGpus:
        """`hosts` with each host's GPUs in increasing order."""
        return tuple((host, tuple(sorted(gpus))) for host, gpus in self.hosts)

    def describe(self) -> str:
        """For log lines: `host:count, ...`."""
        return ", ".join(f"{host}:{len(gpus)}" for host, gpus in self.hosts) or "no GPUs"


@dataclass(frozen=True)
class Placement:
    """A job's GPUs by host: hosts in the order the job got them, GPUs in local-rank order."""

    hosts: HostGpus = ()
    EMPTY: ClassVar[Placement]

    def __post_init__(self) -> None:
        _check_hosts(self.hosts, "placement")

    # Cached: a placement is immutable, and every decision and every worker's `bind` reads
    # its slots and size (thousands of jobs and GPUs on a Perlmutter-sized pool).
    @cached_property
    def size(self) -> int:
        return sum(len(gpus) for _, gpus in self.hosts)

    def slots(self) -> tuple[Slot, ...]:
        return self._slots

    @cached_property
    def _slots(self) -> tuple[Slot, ...]:
        return tuple((host, gpu) for host, gpus in self.hosts for gpu in gpus)

    @cached_property
    def has_empty_host(self) -> bool:
        """A host listed with no GPU (JSON may say so; decisions never make one)."""
        return not all(gpus for _, gpus in self.hosts)

    def describe(self) -> str:
        """For log lines: `host[gpu, ...], ...`."""
        if not self.size:
            return "nothing (pending)"
        return ", ".join(f"{host}{list(gpus)}" for host, gpus in self.hosts)

    def gpus_on(self, host: str) -> tuple[int, ...]:
        """The job's GPUs on `host`; position i is the GPU of local rank i."""
        for name, gpus in self.hosts:
            if name == host:
                return gpus
        return ()

    def to_json(self) -> JsonPlacement:
        return [[host, list(gpus)] for host, gpus in self.hosts]

    @classmethod
    def from_json(cls, data: object) -> Placement:
        """Parse `[[host, [gpu, ...]], ...]`; raises ValueError on any other shape."""
        if not isinstance(data, list):
            raise ValueError(f"placement: expected a list of [host, [gpus]], got {data!r}")
        hosts: list[tuple[str, tuple[int, ...]]] = []
        for entry in data:
            if not (isinstance(entry, list | tuple) and len(entry) == 2):
                raise ValueError(f"placement: expected [host, [gpus]], got {entry!r}")
            host, gpus = entry
            if not isinstance(host, str) or not isinstance(gpus, list | tuple):
                raise ValueError(f"placement: expected [host, [gpus]], got {entry!r}")
            if not all(isinstance(gpu, int) and not isinstance(gpu, bool) for gpu in gpus):
                raise ValueError(f"placement: GPU indices must be integers, got {entry!r}")
            hosts.append((host, tuple(gpus)))
        return cls(tuple(hosts))


Placement.EMPTY = Placement()


@dataclass(frozen=True)
class Demand:
    """What one job asks of the allocator in this decision."""

    name: str
    min: int
    max: int
    desired: int
    priority: int = 0
    arrival: float = 0.0
    gains: tuple[float, ...] = ()
    """What each GPU above `min` would add, in share of one GPU's throughput, in order (the
    first is the gain of GPU `min + 1`). Read only by an allocator that divides GPUs by gain
    (`spare_by_gain`: those above `wanted`; `share_by_gain`: all above `min`); without them
    the job gets no GPU above what it wants."""
    done_fraction: float | None = field(default=None, compare=False)
    """The share of its work the job has done (epochs reported / `training.epochs`); None:
    not known. Read only by an allocator that orders by work left (`policies/queueing.py`);
    not compared, so a new epoch alone does not make a decision."""
    share: bool = False
    """The job's workers may share GPUs with other sharing jobs' (`spec.gpus.share`), each
    on a GPU of its own within the job, by memory (`policies/sharing.py`)."""
    memory_bytes: int | None = None
    """GPU memory one worker asked for (`spec.gpus.memory`)."""
    measured_bytes: int | None = None
    """The largest GPU memory one worker of the job was seen to use (NVML, per process);
    None until measured. A sharing job counts the larger of this (with the operator's
    margin) and `memory_bytes` per worker (`sharing.worker_memory`)."""
    utilization: float | None = None
    """The share of time a kernel of the job ran on each of its GPUs (NVML), in [0, 1]; None
    until measured. Read only by a packing with a cap on a GPU's summed utilization
    (`SharingLimits.max_utilization`), which counts an unmeasured job as 1.0."""
    memory_split_bytes: int | None = None
    """Of the memory its workers hold, the bytes they split among them (the activations of a
    global batch each worker takes its share of, when a resize keeps the global batch):
    one worker of `n` holds `memory_bytes - split / min + split / n`, so `memory_bytes` is
    a worker's at the job's min. None: a worker holds `memory_bytes` at any size."""
    resumable: bool = False
    """The job goes on from a checkpoint when started again (`spec.training.resumable`):
    a queue that preempts may take its GPUs; otherwise it only orders it."""
    min_speedup: float | None = field(default=None, compare=False)
    """The job's goodput at its min, in share of one GPU's (as `gains`); None: its min (as if
    it scaled linearly up to it). Read only by `share_by_speedup` (`policies/power_mean.py`);
    not compared: it moves with the gains, which are, so the decisions are those without it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("demand: name must not be empty")
        if self.done_fraction is not None and not 0 <= self.done_fraction <= 1:
            raise ValueError(
                f"demand {self.name}: done_fraction must be within [0, 1], got {self.done_fraction}"
            )
        if not 1 <= self.min <= self.max:
            raise ValueError(
                f"demand {self.name}: need 1 <= min <= max, got min {self.min} max {self.max}"
            )
        if not math.isfinite(self.arrival):
            raise ValueError(f"demand {self.name}: arrival must be finite, got {self.arrival}")
        self._check_speedups()
        if self.utilization is not None and not 0 <= self.utilization <= 1:
            raise ValueError(
                f"demand {self.name}: utilization must be within [0, 1], got {self.utilization}"
            )
        split = self.memory_split_bytes
        if split is not None and not 0 <= split <= (self.memory_bytes or 0) * self.min:
            raise ValueError(
                f"demand {self.name}: memory_split_bytes must be within [0, memory_bytes x min]"
                f" = [0, {(self.memory_bytes or 0) * self.min}], got {split}"
            )
        for what, value in (("memory_bytes", self.memory_bytes), ("measured", self.measured_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"demand {self.name}: {what} must be >= 0, got {value}")

    def _check_speedups(self) -> None:
        """`gains` (one per GPU above the min at most, each finite and >= 0) and
        `min_speedup` (finite and > 0)."""
        for gain in self.gains:
            if not (math.isfinite(gain) and gain >= 0):
                raise ValueError(f"demand {self.name}: gains must be finite and >= 0, got {gain}")
        if len(self.gains) > self.max - self.min:
            raise ValueError(
                f"demand {self.name}: gains has {len(self.gains)} values, at most max - min"
                f" = {self.max - self.min} allowed (one per GPU above min)"
            )
        speedup = self.min_speedup
        if speedup is not None and not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(
                f"demand {self.name}: min_speedup must be finite and > 0, got {speedup}"
            )

    @cached_property  # read several times per job in every decision
    def wanted(self) -> int:
        """`desired` clamped into [min, max]."""
        return max(self.min, min(self.max, self.desired))


@dataclass(frozen=True)
class Grant:
    """The allocator's answer for one job."""

    placement: Placement
    reason: str

    @property
    def admitted(self) -> bool:
        return self.placement.size > 0


@dataclass(frozen=True)
class Drain:
    """A GPU a job gave back that no other job gets until its workers are seen to leave it.

    The allocator keeps one per draining GPU; the store keeps them with the placements, so
    an operator restarted (or upgraded) while a GPU drains still holds it."""

    job: str
    given_back_at: float
    """When the job gave it back (seconds since the epoch: it outlives the process)."""
    pids: tuple[tuple[str, int], ...] = ()
    """(host, pid) of the workers bound to it when it was given back."""
    after_loss: bool = False
    """Given back because the job lost workers: a report of the smaller size does not free it
    (the report cannot say which GPUs the survivors use); only its worker's exit does."""


@dataclass(frozen=True)
class Allocation:
    """What the allocator holds after a change: every job's placement (pending jobs' empty)
    and the GPUs still draining. The store records it as one write."""

    placements: Mapping[str, Placement]
    draining: Mapping[Slot, Drain] = field(default_factory=dict)
    shared: frozenset[str] = frozenset()
    """The jobs that share GPUs by memory: a GPU may be in several of their placements."""
    service: Mapping[str, ServiceRecord] = field(default_factory=dict)
    """What each job had of the pool under the allocator's queue (empty without one)."""
    memory: Mapping[str, int] = field(default_factory=dict)
    """Bytes one worker of each sharing job that holds GPUs is counted for (0: not known);
    the store logs it per shared GPU for the report."""


@dataclass(frozen=True)
class ServiceRecord:
    """One job's service under the allocator's queue as a restarted operator reads it back,
    so that a restart neither resets the order by service nor the preemption bound. Times
    are wall-clock (the allocator's own clock does not outlive its process)."""

    attained: float
    """GPU-seconds held up to `at`, every run of it together."""
    at: float
    size: int
    """GPUs it held at `at` (they count on while it runs, an operator restart included)."""
    running_since: float | None
    waiting_since: float | None
    preemptions: int
    preempted: str = ""
    """Why its latest preemption took its GPUs, until granted again ('' if not preempted)."""


ADAPTIVE_METRICS = ("gradient_noise_scale", "batch_size", "step_seconds")
"""Names a worker reports in `Report.metrics` for goodput with adaptive batch size (issue 31):
the gradient noise scale in samples (McCandlish et al.'s simple estimate, which Pollux uses),
the global batch in samples during the epoch, and the mean seconds of one optimizer step at
that batch and world size. One list, read by the worker API, the policies and the simulator."""
GRADIENT_NOISE_SCALE_METRIC, BATCH_SIZE_METRIC, STEP_SECONDS_METRIC = ADAPTIVE_METRICS
BASE_BATCH_METRIC = "base_batch_size"
"""Optional beside `ADAPTIVE_METRICS`: the global batch the job's learning rate was tuned
for (the worker API's adaptive policy reports it); without it, the policies take the
smallest batch reported."""
PLACEMENT_METRICS = ("compute_seconds", "nodes")
"""Optional beside `ADAPTIVE_METRICS` (issue 31, what Pollux's agent measures apart from the
step): the mean seconds of one step's local compute (forward and backward passes, gradient
accumulation included, the all-reduce wait left out) over the same steps as `step_seconds`,
and the number of nodes (hosts) the job's workers spanned. With them the `goodput` policy can
fit the synchronisation apart from the compute (`policies/stepfit.py`); reports without them
keep the line fit."""
COMPUTE_SECONDS_METRIC, NODES_METRIC = PLACEMENT_METRICS
DEFAULT_MEASURE_STEPS = 20
"""An adaptive-batch job's workers report their measurement (`Report.measurement`) this many
full steps into each new configuration (a start, a resize, a new batch) unless the spec's
`training.measureSteps` says otherwise: Pollux's agent reports every step and its scheduler
decides every minute, while an epoch end may be hours away (a first epoch of bert or
ImageNet). 20 steps: the first step after a change is left out of the mean (it waits for the
others), and the noise scale averages over several steps."""


@dataclass(frozen=True)
class Report:
    """What a job's workers said once: an epoch end (epoch set), a new world size (epoch None),
    or a measurement within an epoch (`measurement`, epoch None)."""

    epoch: int | None
    time: float
    world_size: int
    metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    rank: int = 0
    measurement: bool = False
    """The adaptive metrics a few steps into a new configuration (`DEFAULT_MEASURE_STEPS`),
    before the epoch ends: the policies that read metrics read it with the epoch ends; an
    epoch's timing and the job's progress ignore it, and it is not a reset."""

    def __post_init__(self) -> None:
        if self.measurement and self.epoch is not None:
            raise ValueError("a measurement is made within an epoch: its epoch must be None")


class ResizeMode(enum.StrEnum):
    """What a resize of a running job does to its workers: each engine says which of these
    its resizes are (`Engine.resize_mode`), so that what a resize cost can say it without
    the reconciler knowing engines."""

    LIVE = "live"
    """The workers that stay keep their processes, and new ones join them (Horovod's
    elastic reset): no worker restarts."""
    RESTART = "restart"
    """Every worker is stopped and started again at the new world size, and resumes from
    the job's own snapshot (torchrun's new membership)."""


@dataclass(frozen=True)
class UsageSample:
    """GPU memory of a job's GPUs at one instant (summed over the GPUs it holds)."""

    time: float
    gpus: int
    used_bytes: int
    total_bytes: int

    @property
    def utilization(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


MODULE_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
"""A dotted Python module name (`torch`, `horovod.torch`): what `spec.horovod.preload` takes
and what the driver's `--preload` checks again: one pattern for both."""
