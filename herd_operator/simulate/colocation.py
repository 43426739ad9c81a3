"""Co-location in the simulator: how much slower a worker runs next to other jobs' workers on
its GPU, how busy each job keeps a GPU, and how much memory a Pollux application's worker
holds.

Apart from the job model (`model.py`) because it is only read when jobs share GPUs
(`simulate --policy NAME+pack`), and every figure here has its own source, cited where it is
defined and in docs/simulation.md ("Co-location").
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from herd_operator.policies.sharing import SharingLimits
from herd_operator.simulate.model import (
    GPU_MEMORY_BYTES,
    MAX_MEMORY_FRACTION,
    JobModel,
    feasible_min,
)

INTERFERENCE_POINTS: tuple[tuple[float, float], ...] = (
    (0.0, 1.00),
    (1.0, 1.10),
    (2.0, 1.61),
)
"""(summed GPU utilization of the jobs on one GPU, slowdown of each of them), interpolated
linearly; past the last point the slowdown grows one for one with the summed utilization
(a saturated GPU time-slices: each unit of busy time asked adds a unit of wall time).

- 2.0 -> 1.61: two jobs that each keep a GPU busy alone. The mean of the twelve slowdowns
  of Gavel's measured pairs (OSDI'20; `scheduler/packing_experiment_throughputs.json` of
  stanford-futuredata/gavel: ResNet-50 at batch 59, Transformer at 98, LM at 276, every
  pair on one P100, throughput alone against packed): 1.95 and 1.95 (ResNet-50 twice),
  1.30 / 2.06 (ResNet-50 / Transformer), 1.88 / 1.46 (ResNet-50 / LM), 1.54 and 1.53
  (Transformer twice), 1.01 / 1.01 (Transformer / LM), 1.86 and 1.83 (LM twice).
- 1.0 -> 1.10: ours. Jobs whose busy time together fits one GPU still contend for memory
  bandwidth, caches and the kernel queue; Gandiva (OSDI'18, as summarised) reports both ways for
  jobs that fit: two LM jobs each 19% slower, ResNet-50 next to LM not slowed. 10% sits
  between; our GPU script (`scripts/gpu_share_bench.py`) is how to replace it.
- 0 -> 1.00: a job alone.
"""

SIMULATED_SHARING = SharingLimits(gpu_memory_bytes=GPU_MEMORY_BYTES)
"""The sharing allocator's settings in the simulator by default: `run --share-gpus`'s, on the
model's GPUs."""

SLOWDOWN_LIMIT = 1.25
"""The issue's bound: no job slowed more than 25% by its neighbours."""

UTILIZATION_BANDS: tuple[tuple[float, float, float], ...] = (
    (0.25, 0.15, 0.65),
    (1.00, 0.40, 1.00),
)
"""(memory used at the asked size up to, low, high): a Perlmutter-like job's GPU utilization
(share of time a kernel runs), uniform in [low, high] of the first band its memory falls in.
Ours: no published per-job distribution for Perlmutter; small-memory jobs are taken to be
small models or batches, which leave a GPU idle more often."""


def interference_slowdown(utilizations: Sequence[float]) -> float:
    """The slowdown of every job on one GPU whose jobs have these GPU utilizations (each in
    [0, 1]); one job alone (or none) runs at full speed, 1.0."""
    for value in utilizations:
        if not 0.0 <= value <= 1.0 or math.isnan(value):
            raise ValueError(f"utilization must be within [0, 1], got {value}")
    if len(utilizations) <= 1:
        return 1.0
    total = math.fsum(utilizations)
    xs = [x for x, _ in INTERFERENCE_POINTS]
    last_x, last_y = INTERFERENCE_POINTS[-1]
    if total >= last_x:
        return last_y + (total - last_x)
    index = bisect.bisect_right(xs, total)
    (x0, y0), (x1, y1) = INTERFERENCE_POINTS[index - 1], INTERFERENCE_POINTS[index]
    return y0 + (y1 - y0) * (total - x0) / (x1 - x0)


def job_slowdown(per_gpu: Iterable[float]) -> float:
    """A data-parallel job steps at the pace of its slowest worker: the largest slowdown of
    its GPUs (1.0 for none)."""
    return max(per_gpu, default=1.0)


def with_utilization(jobs: Sequence[JobModel], seed: int) -> list[JobModel]:
    """The jobs with a GPU utilization each from `UTILIZATION_BANDS`, drawn from a stream of
    their own (so the mix's jobs stay what the seed made them); a job that already has one
    below 1.0 (a trace's application) keeps it."""
    rng = random.Random(f"utilization-{seed}")
    out = []
    for job in jobs:
        used = job.memory_fraction(job.requested)
        low, high = next((lo, hi) for top, lo, hi in UTILIZATION_BANDS if used <= top)
        draw = rng.uniform(low, high)
        if job.gpu_utilization < 1.0:
            out.append(job)
        else:
            out.append(dataclasses.replace(job, gpu_utilization=draw))
    return out


@dataclass(frozen=True)
class AppMemory:
    """What one worker of an application holds on its GPU, estimated from published sizes."""

    parameters: float
    """Model parameters (published counts)."""
    state_bytes_per_parameter: int
    """fp32 weights and gradients (8) plus the optimizer's state: SGD with momentum 4,
    Adam 8."""
    activation_bytes_per_sample: float
    """Activations kept for the backward pass, per sample of the local batch (our estimate
    from the layer shapes at the input size; see docs/simulation.md)."""
    utilization: float
    """GPU utilization of one worker (ours, from the step times Pollux measured: a job whose
    step is mostly synchronisation leaves its GPU idle)."""


CUDA_CONTEXT_BYTES = 600 << 20
"""The CUDA context and the framework's kernels and workspace of one process (PyTorch on an
A100: about 0.5-0.7 GB before the first tensor)."""
MAX_ACTIVATION_FRACTION = 0.80
"""A local batch whose activations pass this share of the GPU runs in several micro-batches
(gradient accumulation, as Pollux's simulator assumes for yolov3): the activations held are
capped there."""

POLLUX_APPS: Mapping[str, AppMemory] = {
    # ResNet-18 for CIFAR-10 (11.2 M parameters), SGD; 32x32 inputs: ~8 MB per sample.
    "cifar10": AppMemory(11.2e6, 12, 8e6, 0.6),
    # ResNet-50 (25.6 M), SGD; 224x224: ~100 MB per sample in fp32.
    "imagenet": AppMemory(25.6e6, 12, 100e6, 0.9),
    # BERT-base fine-tuning on SQuAD (110 M), Adam; 384 tokens: ~0.75 GB per sample.
    "bert": AppMemory(110e6, 16, 750e6, 0.9),
    # DeepSpeech2 (~26 M as in Pollux's artifact), SGD; spectrograms: ~60 MB per sample.
    "deepspeech2": AppMemory(26e6, 12, 60e6, 0.7),
    # YOLOv3 (61.9 M), SGD; 416x416: ~600 MB per sample.
    "yolov3": AppMemory(61.9e6, 12, 600e6, 0.8),
    # NeuMF on MovieLens-1M (~1.2 M, embeddings), Adam; ~2 KB per sample.
    "ncf": AppMemory(1.2e6, 16, 2e3, 0.3),
}
"""Per application of Pollux's workloads (petuum/adaptdl `simulator/`)."""


def worker_memory_bytes(application: str, global_batch: int, workers: int) -> int:
    """Bytes one of `workers` workers of `application` holds at `global_batch` (batch
    preserving: each takes global / workers samples). Raises ValueError for an unknown
    application or a bad size."""
    app = POLLUX_APPS.get(application)
    if app is None:
        raise ValueError(f"application {application!r}: known: {', '.join(sorted(POLLUX_APPS))}")
    if workers < 1 or global_batch < 1:
        raise ValueError("workers and global_batch must be >= 1")
    fixed = CUDA_CONTEXT_BYTES + app.parameters * app.state_bytes_per_parameter
    local = global_batch / workers
    activations = min(app.activation_bytes_per_sample * local,
                      MAX_ACTIVATION_FRACTION * GPU_MEMORY_BYTES - fixed)  # fmt: skip
    return int(fixed + max(activations, 0.0))


def with_published_memory(jobs: Sequence[JobModel], min_share: float = 0.25) -> list[JobModel]:
    """A trace's jobs with each application's estimated memory (`POLLUX_APPS`) and GPU
    utilization in place of the guessed share (`calibration.POLLUX_MEMORY`); the min is set
    again as the workload does (a share of the asked size, or what the memory needs). Jobs
    without an application are kept as they are."""
    out = []
    for job in jobs:
        app = POLLUX_APPS.get(job.application)
        if app is None or job.batch_size < 1:
            out.append(job)
            continue
        fixed = (CUDA_CONTEXT_BYTES + app.parameters * app.state_bytes_per_parameter) / (
            GPU_MEMORY_BYTES
        )
        at_asked = worker_memory_bytes(job.application, job.batch_size, job.requested)
        batch = (at_asked / GPU_MEMORY_BYTES - fixed) * job.requested
        batch = min(batch, (MAX_MEMORY_FRACTION - fixed) * job.requested)
        low = min(
            job.requested,
            max(feasible_min(fixed, batch), math.ceil(job.requested * min_share)),
        )
        out.append(
            dataclasses.replace(
                job,
                mem_fixed=fixed,
                mem_batch=batch,
                min_gpus=low,
                gpu_utilization=app.utilization,
            )
        )
    return out


Slot = tuple[str, int]


class GpuOccupancy:
    """Which jobs' workers are on each GPU, with their utilizations: what each job's
    interference slowdown is now, and how many GPUs hold at least one job."""

    def __init__(self) -> None:
        self._on: dict[Slot, dict[str, float]] = {}
        self._slots: dict[str, tuple[Slot, ...]] = {}

    @property
    def occupied(self) -> int:
        """GPUs holding at least one job's worker."""
        return len(self._on)

    def place(self, job: str, slots: Sequence[Slot], utilization: float) -> set[str]:
        """`job` now runs on `slots` (none: it left); returns the jobs whose neighbours
        changed (it among them), whose slowdown must be computed again."""
        touched = {job}
        for slot in self._slots.pop(job, ()):
            jobs = self._on[slot]
            del jobs[job]
            touched.update(jobs)
            if not jobs:
                del self._on[slot]
        if slots:
            self._slots[job] = tuple(slots)
            for slot in slots:
                jobs = self._on.setdefault(slot, {})
                touched.update(jobs)
                jobs[job] = utilization
        return touched

    def slowdown(self, job: str) -> float:
        """`job`'s slowdown now: its slowest GPU's (1.0 when it holds none or shares none)."""
        return job_slowdown(
            interference_slowdown(tuple(self._on[slot].values()))
            for slot in self._slots.get(job, ())
        )

    def sharing(self, job: str) -> int:
        """The most jobs on one of `job`'s GPUs (it included; 0 when it holds none)."""
        return max((len(self._on[slot]) for slot in self._slots.get(job, ())), default=0)


def sharing_request(
    model: JobModel, pack: bool, share_utilization: float
) -> tuple[bool, int | None, None, float | None, int | None]:
    """(`Demand.share`, `.memory_bytes`, `.measured_bytes`, `.utilization`,
    `.memory_split_bytes`): under `pack` a job whose GPU utilization is at most
    `share_utilization` opts in and asks for what one worker holds at its min, with the part
    of it its workers split (its batch's activations: batch preserving, a worker of a bigger
    job holds less), so a GPU is never over-committed at any size it is given. Its utilization
    is known from its admission (as from a profiling run or an earlier run of the same job:
    the operator measures it only once the job ran)."""
    if not pack or model.gpu_utilization > share_utilization:
        return False, None, None, None, None
    at_min = model.mem_fixed + model.mem_batch / model.min_gpus
    memory = math.ceil(model.memory_fraction(model.min_gpus) * GPU_MEMORY_BYTES)
    # Past a whole GPU the model caps what a worker holds: no split is known to be right then.
    split = int(model.mem_batch * GPU_MEMORY_BYTES) if at_min <= 1.0 else None
    return True, memory, None, model.gpu_utilization, split


def utilization_within(slowdown: float) -> float:
    """The largest summed utilization of a GPU's jobs at which `interference_slowdown` stays
    within `slowdown` (> 1): the cap (`SharingLimits.max_utilization`) that keeps every
    co-located job within it in this model. Inverts the table's linear pieces."""
    if not slowdown > 1.0 or not math.isfinite(slowdown):
        raise ValueError(f"slowdown must be finite and > 1, got {slowdown}")
    for (x0, y0), (x1, y1) in itertools.pairwise(INTERFERENCE_POINTS):
        if slowdown <= y1:
            return x0 + (x1 - x0) * (slowdown - y0) / (y1 - y0)
    last_x, last_y = INTERFERENCE_POINTS[-1]
    return last_x + (slowdown - last_y)
