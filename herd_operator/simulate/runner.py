"""Runs one workload under several policies and writes what they did."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.policies.queueing import QUEUE_MODES, QueueConfig
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.simulate.baselines import BASELINES, run_baseline
from herd_operator.simulate.colocation import (
    SIMULATED_SHARING,
    with_published_memory,
    with_utilization,
)
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import JobModel
from herd_operator.simulate.results import SimResult
from herd_operator.simulate.workload import (
    MixParams,
    batch_widened,
    load_trace,
    perlmutter_mix,
    rigid,
)
from herd_operator.specs import PolicyRef
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS, Pool

FIRST_COME = "fcfs"
"""Not a policy of the operator: every job rigid at its asked size (min = max), `static`,
so the allocator admits in arrival order with no resize: a batch scheduler without backfill."""
POLICIES = ("fcfs", "static", "memory", "goodput")
PERLMUTTER = "perlmutter"
ALLOCATOR_OPTIONS = {
    "spare": "spare_by_gain",
    "share": "share_by_gain",
    "speedup": "share_by_speedup",
    "small": "smallest_first",
    "pack": "pack",
}
"""`POLICY+OPTION[+OPTION]`: the policy under an allocator with these opt-in behaviours:
`+spare` lends spare GPUs by gain, `+share` divides every GPU above the mins by gain (which
includes lending: the two are not combined), `+speedup` divides them by the harmonic mean of
speedups instead (Pollux's objective: `policies/power_mean.py`), `+small` admits the smallest
pending job first, `+pack` lets jobs share GPUs by their memory (slowed by their neighbours:
`colocation.py`). `+las`, `+srpt`, `+fifo`: the allocator's queue (`policies/queueing.py`);
`+fifo` is none. `+adaptive` is the jobs' option (`JOB_OPTIONS`)."""
JOB_OPTIONS = {"adaptive": "adaptive_batch"}
"""`POLICY+adaptive`: the jobs with a noise profile report the adaptive metrics, train at
the batch the policy picks (`simulate/batching.py`), may grow past their trace's GPUs as
far as their max batch spreads and shrink to one GPU (`workload.batch_widened`)."""


def parse_pool(text: str) -> Pool:
    """`NODESxGPUS`, e.g. `1792x4`: hosts nid000000... with GPUs 0..GPUS-1 each."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"pool {text!r}: expected NODESxGPUS, e.g. 1792x4")
    nodes, gpus = int(match[1]), int(match[2])
    return Pool.from_counts({f"nid{node:06d}": gpus for node in range(nodes)})


@dataclass(frozen=True)
class Workload:
    description: str
    jobs: list[JobModel]


def load_workload(
    spec: str, pool: Pool, jobs: int, seed: int, load: float, published_memory: bool = False
) -> Workload:
    """`perlmutter` (the generated mix, each job with a GPU utilization of its own stream) or
    the path of a CSV trace (with `published_memory`, each application's estimated memory and
    utilization instead of the guessed memory: `colocation.with_published_memory`)."""
    if spec == PERLMUTTER:
        mix = with_utilization(perlmutter_mix(jobs, pool.size, seed, MixParams(load=load)), seed)
        return Workload(f"Perlmutter-like mix, {jobs} jobs, seed {seed}, load {load:g}", mix)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"workload {spec!r}: not '{PERLMUTTER}' and not a file")
    trace = load_trace(path, pool.size)
    if published_memory:
        return Workload(f"trace {path.name}, published memory", with_published_memory(trace))
    return Workload(f"trace {path.name}", trace)


def parse_policy(text: str) -> tuple[str, PolicyRef]:
    """`name` or `name:param=value/param=value` (values in JSON): the label and the ref."""
    name, _, rest = text.partition(":")
    params: dict[str, object] = {}
    for pair in filter(None, rest.split("/")):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"policy {text!r}: expected name:param=value/param=value")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    if name == FIRST_COME:
        if params:
            raise ValueError(f"policy {text!r}: {FIRST_COME} takes no params")
        return text, PolicyRef(name="static")
    return text, PolicyRef(name=name, params=params)


def parse_allocator_options(
    text: str, queue: str = "fifo"
) -> tuple[str, dict[str, bool], QueueConfig | None]:
    """`policy+spare+small+las` -> (`policy`, the `SimConfig` flags those options turn on,
    the queue: `+las`, `+srpt` or `+fifo`, else `queue`'s)."""
    policy, *options = text.split("+")
    flags: dict[str, bool] = {}
    modes = [option for option in options if option in QUEUE_MODES]
    if len(modes) > 1:
        raise ValueError(f"policy {text!r}: more than one queue ({', '.join(modes)})")
    mode = modes[0] if modes else queue
    if mode not in QUEUE_MODES:
        raise ValueError(f"queue {mode!r}: expected one of {', '.join(QUEUE_MODES)}")
    for option in (option for option in options if option not in QUEUE_MODES):
        if option in JOB_OPTIONS:
            flags[JOB_OPTIONS[option]] = True
            continue
        if option not in ALLOCATOR_OPTIONS:
            allowed = ", ".join(f"+{name}" for name in ALLOCATOR_OPTIONS)
            raise ValueError(f"policy {text!r}: unknown allocator option +{option} ({allowed})")
        flags[ALLOCATOR_OPTIONS[option]] = True
    if flags.get("spare_by_gain") and (flags.get("share_by_gain") or flags.get("share_by_speedup")):
        raise ValueError(
            f"policy {text!r}: +share and +speedup already lend spare GPUs; drop +spare"
        )
    if flags.get("share_by_gain") and flags.get("share_by_speedup"):
        raise ValueError(f"policy {text!r}: +share and +speedup are two divisions; keep one")
    return policy, flags, None if mode == "fifo" else QueueConfig(mode)


def simulate(
    workload: Workload,
    pool: Pool,
    policies: Sequence[str],
    tick: float,
    resync: float = 0.0,
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
    queue: str = "fifo",
    share_utilization: float = 1.0,
    sharing: SharingLimits = SIMULATED_SHARING,
    measure_steps: int = DEFAULT_MEASURE_STEPS,
) -> list[SimResult]:
    results = []
    for text in policies:
        if text in BASELINES:
            results.append(run_baseline(text, workload.jobs, pool.size))
            continue
        policy, flags, queued = parse_allocator_options(text, queue)
        label, ref = parse_policy(policy)
        jobs = rigid(workload.jobs) if label == FIRST_COME else workload.jobs
        if flags.get("adaptive_batch") and label != FIRST_COME:
            jobs = batch_widened(jobs, pool.size)
        config = SimConfig(
            pool, ref, tick=tick, resync=resync, max_wait_seconds=max_wait_seconds,
            queue=queued, share_utilization=share_utilization,
            sharing=sharing, measure_steps=measure_steps, **flags,
        )  # fmt: skip
        result = Simulation(jobs, config).run()
        result.policy = text
        results.append(result)
    return results


def describe_timing(results: Sequence[SimResult], arbitration_ms: float) -> str:
    """Where the time went, per policy, against decisions x one benchmarked arbitration."""
    lines = []
    for r in results:
        budget = r.decisions * arbitration_ms / 1000
        lines.append(
            f"- {r.policy}: {r.wall_seconds:.1f} s wall for {len(r.jobs)} jobs, {r.events} events"
            f" in {r.batches} instants; {r.decisions} decisions took {r.decide_seconds:.1f} s"
            f" ({r.decide_seconds / max(r.decisions, 1) * 1000:.2f} ms each), {r.policy_calls}"
            f" policy calls and requests {r.policy_seconds:.1f} s; decisions x"
            f" {arbitration_ms:g} ms (the arbitration benchmark) = {budget:.1f} s,"
            f" wall / that = {r.wall_seconds / budget if budget else float('nan'):.2f}"
        )
    return "\n".join(lines)
