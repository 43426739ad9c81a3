"""Workloads for the simulator: a seeded Perlmutter-like mix, and job traces in CSV.

Each distribution of the generated mix, and where it comes from, is in docs/simulation.md.
Where no published figure exists the choice is ours and the docs say so.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.simulate.batching import BatchModel, batch_model
from herd_operator.simulate.calibration import (
    DEFAULT_BATCH,
    POLLUX_CALIBRATIONS,
    POLLUX_MEMORY,
    Calibration,
)
from herd_operator.simulate.model import MAX_MEMORY_FRACTION, JobModel, feasible_min
from herd_operator.simulate.pollux_profiles import POLLUX_BATCHING

GPU_COUNT_WEIGHTS: tuple[tuple[int, float], ...] = (
    (1, 0.30),
    (2, 0.08),
    (4, 0.35),
    (8, 0.10),
    (16, 0.08),
    (32, 0.05),
    (64, 0.025),
    (128, 0.01),
    (256, 0.005),
)
"""GPUs asked per job: a third single-GPU, a third one full node (4 GPUs), a tail to 64 nodes."""
RUN_MEDIAN_SECONDS = 1800.0
RUN_SIGMA = 1.2
RUN_BOUNDS = (120.0, 48 * 3600.0)
"""Run time at the asked size: log-normal, median 30 min, cut at 2 min and at 48 h (the
longest wall time of Perlmutter's regular GPU queue)."""
SERIAL_BOUNDS = (0.005, 0.2)
"""Amdahl serial fraction: log-uniform, from near-linear to 59% efficiency at 8 GPUs."""
MEMORY_BANDS: tuple[tuple[float, float, float], ...] = (
    (0.50, 0.03, 0.25),
    (0.30, 0.25, 0.60),
    (0.20, 0.60, 0.90),
)
"""(share of jobs, low, high) of the memory used per GPU at the asked size: half the jobs use
at most 25% (Li et al., ISC'23, on Perlmutter); the split of the other half is ours."""
EPOCH_SECONDS = (60.0, 900.0)
"""Epoch length at the asked size: uniform; at most 200 epochs per job."""


@dataclass(frozen=True)
class MixParams:
    load: float = 0.9
    """Offered load: GPU-seconds asked (size x run time at that size) per second, as a share
    of the pool; sets the arrival rate."""
    min_share: float = 0.25
    """An elastic job's min is this share of its asked size (rounded up), or what its memory
    needs if more."""


def perlmutter_mix(
    count: int, pool_gpus: int, seed: int, params: MixParams = MixParams()
) -> list[JobModel]:
    """`count` jobs with Poisson arrivals; the same seed gives the same jobs."""
    rng = random.Random(seed)
    sizes = [size for size, _ in GPU_COUNT_WEIGHTS if size <= pool_gpus] or [pool_gpus]
    weights = [weight for size, weight in GPU_COUNT_WEIGHTS if size <= pool_gpus] or [1.0]
    drafts: list[tuple[int, float, float, float, float, int]] = []
    for _ in range(count):
        requested = rng.choices(sizes, weights)[0]
        run = math.exp(rng.gauss(math.log(RUN_MEDIAN_SECONDS), RUN_SIGMA))
        run = min(max(run, RUN_BOUNDS[0]), RUN_BOUNDS[1])
        serial = math.exp(rng.uniform(math.log(SERIAL_BOUNDS[0]), math.log(SERIAL_BOUNDS[1])))
        band = rng.choices(MEMORY_BANDS, [share for share, _, _ in MEMORY_BANDS])[0]
        used = rng.uniform(band[1], band[2])
        fixed_share = rng.uniform(0.2, 0.6)
        epochs = max(1, min(200, round(run / rng.uniform(*EPOCH_SECONDS))))
        drafts.append((requested, run, serial, used, fixed_share, epochs))
    asked = sum(requested * run for requested, run, *_ in drafts) / max(count, 1)
    rate = params.load * pool_gpus / asked if asked else 1.0
    jobs: list[JobModel] = []
    clock = 0.0
    width = len(str(max(count - 1, 0)))
    for index, (requested, run, serial, used, fixed_share, epochs) in enumerate(drafts):
        clock += rng.expovariate(rate)
        jobs.append(
            _job(
                f"job-{index:0{width}d}",
                clock,
                requested,
                run,
                serial,
                used,
                fixed_share,
                epochs,
                params.min_share,
            )
        )
    return jobs


def _job(
    name: str,
    arrival: float,
    requested: int,
    run: float,
    serial: float,
    used: float,
    fixed_share: float,
    epochs: int,
    min_share: float,
    scale_limit: int = 0,
    batching: BatchModel | None = None,
) -> JobModel:
    mem_fixed = fixed_share * used
    mem_batch = (1 - fixed_share) * used * requested
    low = min(requested, max(feasible_min(mem_fixed, mem_batch), math.ceil(requested * min_share)))
    speedup = requested / (1.0 + serial * (requested - 1))
    return JobModel(
        name=name,
        arrival=arrival,
        requested=requested,
        min_gpus=low,
        max_gpus=requested,
        work=run * speedup,
        epochs=epochs,
        serial_fraction=serial,
        mem_fixed=mem_fixed,
        mem_batch=mem_batch,
        scale_limit=scale_limit,
        batching=batching,
    )


TRACE_COLUMNS = ("name", "time", "application", "num_replicas")
"""Required; `batch_size` is read when present (else the application's `DEFAULT_BATCH`)."""


def load_trace(
    path: Path,
    pool_gpus: int,
    calibrations: Mapping[tuple[str, int], Calibration] = POLLUX_CALIBRATIONS,
    min_share: float = 0.25,
) -> list[JobModel]:
    """Jobs of a CSV trace in Pollux's format (`name,time,application,num_replicas,...`):
    each application's work and scaling at the row's batch size from `calibrations`
    (Pollux's measured traces, fitted: `herd_operator/simulate/calibration.py`), and its
    noise profile for adaptive batch where `POLLUX_BATCHING` has one (`batching.py`).

    Raises ValueError naming the line of a bad row.
    """
    applications = sorted({app for app, _ in calibrations})
    with path.open(newline="") as stream:
        reader = csv.DictReader(stream)
        missing = [column for column in TRACE_COLUMNS if column not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        jobs: list[JobModel] = []
        for row in reader:
            where = f"{path}:{reader.line_num}"
            application = row["application"]
            if application not in applications:
                raise ValueError(
                    f"{where}: unknown application {application!r};"
                    f" known: {', '.join(applications)}"
                )
            try:
                arrival = float(row["time"])
                replicas = int(row["num_replicas"])
                batch = int(row.get("batch_size") or DEFAULT_BATCH[application])
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            if replicas < 1 or not math.isfinite(arrival):
                raise ValueError(f"{where}: num_replicas must be >= 1 and time finite")
            fit = calibrations.get((application, batch))
            if fit is None:
                known = sorted(b for app, b in calibrations if app == application)
                raise ValueError(
                    f"{where}: batch_size {batch} of {application} is not calibrated;"
                    f" calibrated: {', '.join(map(str, known))}"
                )
            requested = min(replicas, pool_gpus)
            used = min(POLLUX_MEMORY[application], MAX_MEMORY_FRACTION - 0.05)
            speedup = requested / (1.0 + fit.serial_fraction * (requested - 1))
            noise = POLLUX_BATCHING.get(application)
            jobs.append(
                _job(
                    row["name"],
                    arrival,
                    requested,
                    fit.work / speedup,
                    fit.serial_fraction,
                    used,
                    0.4,
                    fit.epochs,
                    min_share,
                    max(gpus for gpus, _ in fit.measured),
                    None if noise is None else batch_model(fit, noise),
                )
            )
            # What the co-location model's memory estimate reads (`colocation.py`).
            jobs[-1] = dataclasses.replace(jobs[-1], application=application, batch_size=batch)
    jobs.sort(key=lambda job: (job.arrival, job.name))
    return jobs


def batch_widened(jobs: Sequence[JobModel], pool_gpus: int) -> list[JobModel]:
    """The jobs as adaptive batch runs them (`+adaptive`): one with a noise profile may grow
    past the GPUs its trace row asks for, up to the most GPUs its max batch spreads over at
    its smallest local batch (`BatchModel.widest`; Pollux's simulator bounds a job's replicas
    so, `max_batch_size // min_local_bsz` in `simulator/simulator.py` of the artifact) and
    the pool. Its steps come from its step model (`steptime.py`, fitted to every size Pollux
    measured, 1-64 GPUs), not from the Amdahl fit, so the sizes that fit was measured at
    (`scale_limit`) do not bound it. Never below what it asked. Its min is one GPU: any
    batch it trains at, its base batch first, fits one GPU's memory in micro-batches of its
    largest local batch (`StepModel.seconds`), and Pollux's jobs have no min either; the
    trace's min (a quarter of the ask) is this simulator's, for rigid batches. The others
    unchanged."""
    widened: list[JobModel] = []
    for job in jobs:
        if job.batching is not None:
            widest = max(job.max_gpus, min(job.batching.widest(), pool_gpus))
            job = dataclasses.replace(job, min_gpus=1, max_gpus=widest)
        widened.append(job)
    return widened


def rigid(jobs: Sequence[JobModel]) -> list[JobModel]:
    """The same jobs as a batch scheduler runs them: min = max = the asked size."""
    return [
        dataclasses.replace(job, min_gpus=job.requested, max_gpus=job.requested) for job in jobs
    ]
