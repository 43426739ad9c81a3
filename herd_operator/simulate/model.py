"""The simulated job: how fast it trains on n GPUs, what a resize costs, how much GPU memory
it uses.

Throughput follows Amdahl's law in the job's serial fraction `f` (the share of a step that
does not shrink with more workers: gradient exchange, input pipeline): on n GPUs a job does
`n / (1 + f (n - 1))` single-GPU seconds of work per second. Its total work is counted in
those units, so a job with `work` W runs W seconds on one GPU.

Memory is batch-preserving, as under the operator's accuracy modes: the global batch stays
the same whatever the size, so each GPU holds the model state (`mem_fixed`, a fraction of one
GPU's memory) plus its share of the batch's activations (`mem_batch / n`). Shrinking a job
raises its per-GPU use, which is the signal the `memory` policy reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from herd_operator.policies.power_mean import GROW_STALL_SECONDS
from herd_operator.simulate.batching import BatchModel

SHRINK_STALL_SECONDS = 0.3
"""A shrink's stall: `resize-stall 4->2` under the driver (docs/benchmarks.md, runs 7 and 8:
medians 0.30 and 0.27 s, n = 3 each); the demo's recorded shrinks 3 -> 2 took 0.0 and 0.3 s
(`herd-operator replay`, docs/simulation.md). Under horovodrun's launch it was 2.0 s (run 3)."""
TORCHRUN_GROW_STALL_SECONDS = 11.1
"""A grow's stall under the torchrun engine: every worker starts again at the new size from
the job's snapshot. The time without a training step of `herd-operator bench --only
torchrun-resize-stall` 2 -> 4 under the operator (median, n = 3, load 1.1-2.1;
docs/benchmarks.md run 20; bare torchrun 11.3 s). From the grant to the first step at 4 it
was 15.3 s: the old workers train on at 2 while the new agents start (the first 4.2 s),
which this model, with the new size from the grant on, counts at 4."""
TORCHRUN_SHRINK_STALL_SECONDS = 12.2
"""A shrink's stall under the torchrun engine: the stopped agents' heartbeats lapse, the
round's last call, every worker's restart. The same run's 4 -> 2, its time without a step
(median, n = 3; 12.1 s from the grant to the first step at 2; bare torchrun 13.7 s)."""
ENGINES = ("horovod", "torchrun")
START_SECONDS = 33.3
"""A first launch, from the grant to the first progress: a new driver, every worker's
interpreter and imports, the rendezvous, the script's own set-up (data, model). The median of
the two first launches of the demo's recorded run at load average 5-6 (25.5 and 41.1 s,
`herd-operator replay`, docs/simulation.md); at load 10-12 they took 62-67 s. Measured on the
shared 2-core machine, with CPU workers: a start on a quiet GPU node is likely shorter (a cold
`import torch, torchvision` alone takes about 11 s there, docs/perlmutter.md)."""
GPU_MEMORY_BYTES = 40 << 30
"""One A100 40 GB, the smaller of Perlmutter's two GPU node kinds."""
MAX_MEMORY_FRACTION = 0.95
"""A job does not run on fewer GPUs than keep it under this share of each GPU's memory."""


@dataclass(frozen=True)
class JobModel:
    """One job of a workload: what it asks for and how it behaves."""

    name: str
    arrival: float
    """Submission time, seconds from the start of the workload."""
    requested: int
    """The GPUs a user would ask a batch scheduler for (the rigid size)."""
    min_gpus: int
    max_gpus: int
    work: float
    """Total work in single-GPU seconds."""
    epochs: int
    serial_fraction: float
    mem_fixed: float
    """Per-GPU memory for the model state, as a fraction of one GPU's memory."""
    mem_batch: float
    """Memory of the global batch's activations, as a fraction of one GPU's memory."""
    priority: int = 0
    start_seconds: float | None = None
    """Seconds from a grant to the first progress of a fresh launch; None: the measured
    `START_SECONDS` (a replay sets what the recorded job took)."""
    scale_limit: int = 0
    """The most GPUs its scaling was measured at (a trace's calibration); 0: not known. Read
    by the Optimus baseline, which grows a job up to it (`baselines.py`)."""
    engine: str = "horovod"
    """What runs it: its resizes stall as that engine's measured ones (`resize_stall`)."""
    gpu_utilization: float = 1.0
    """Share of the time a kernel of the job runs on each of its GPUs: what its neighbours
    on a shared GPU slow it by (`colocation.interference_slowdown`). 1.0: it keeps its GPU
    busy, the worst neighbour."""
    application: str = ""
    """A trace's application (Pollux's names), for its memory estimate; "" for the mix."""
    batch_size: int = 0
    """A trace's global batch; 0: not known."""
    batching: BatchModel | None = None
    """Its noise profile and step time at other batches (`batching.py`); None: it trains at
    its trace's batch only."""
    resumable: bool = True
    """It goes on from the end of its last epoch when started again (`training.resumable`),
    so a queue may preempt it. Every job of a trace and of the mix is: Pollux's jobs
    checkpoint, and the simulator restarts a preempted job there."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise ValueError(f"{self.name}: need 1 <= min <= max")
        if self.work <= 0 or self.epochs < 1:
            raise ValueError(f"{self.name}: work and epochs must be positive")
        if not 0 <= self.serial_fraction <= 1:
            raise ValueError(f"{self.name}: serial fraction must be within [0, 1]")
        if self.start_seconds is not None and self.start_seconds < 0:
            raise ValueError(f"{self.name}: start_seconds must be >= 0")
        if not 0.0 <= self.gpu_utilization <= 1.0:
            raise ValueError(f"{self.name}: gpu_utilization must be within [0, 1]")
        if self.engine not in ENGINES:
            raise ValueError(f"{self.name}: engine must be one of {', '.join(ENGINES)}")

    def stall(self, old: int, new: int) -> float:
        """`resize_stall`, with this job's own launch time if it has one."""
        if old <= 0 < new and self.start_seconds is not None:
            return self.start_seconds
        return resize_stall(old, new, self.engine)

    def speedup(self, gpus: int) -> float:
        """Work per second on `gpus` GPUs, in single-GPU seconds per second."""
        if gpus <= 0:
            return 0.0
        return gpus / (1.0 + self.serial_fraction * (gpus - 1))

    def rate(self, gpus: int, batch: int | None, fraction: float) -> float:
        """Work per second on `gpus` GPUs at global batch `batch` (None: at its trace's, its
        `speedup`; a batch: adaptive, `batching.py`'s model), `fraction` of its epochs done
        (the noise scale changes as it trains)."""
        if self.batching is None or batch is None:
            return self.speedup(gpus)
        return self.batching.rate(gpus, batch, fraction)

    def epoch_work(self) -> float:
        return self.work / self.epochs

    def memory_fraction(self, gpus: int) -> float:
        """Share of each of its GPUs' memory the job uses on `gpus` GPUs (at most 1)."""
        if gpus <= 0:
            return 0.0
        return min(1.0, self.mem_fixed + self.mem_batch / gpus)

    def run_seconds(self, gpus: int) -> float:
        """Training time at a fixed size, without stalls."""
        return self.work / self.speedup(gpus)


def resize_stall(old: int, new: int, engine: str = "horovod") -> float:
    """Seconds without progress after the job's size changed from `old` to `new` GPUs on
    `engine`."""
    if new <= 0 or old == new:
        return 0.0
    if old <= 0:
        return START_SECONDS
    if engine == "torchrun":
        return TORCHRUN_GROW_STALL_SECONDS if new > old else TORCHRUN_SHRINK_STALL_SECONDS
    return GROW_STALL_SECONDS if new > old else SHRINK_STALL_SECONDS


def feasible_min(mem_fixed: float, mem_batch: float) -> int:
    """The fewest GPUs whose memory holds the job (per-GPU use under MAX_MEMORY_FRACTION)."""
    room = MAX_MEMORY_FRACTION - mem_fixed
    if room <= 0:
        raise ValueError("the model state alone does not fit one GPU")
    return max(1, math.ceil(mem_batch / room - 1e-9))
