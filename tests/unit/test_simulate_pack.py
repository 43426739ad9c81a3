"""The simulator under `+pack`: the real sharing allocator (`policies/sharing.py`) places the
jobs, the co-location model slows the jobs that share a GPU, a shared GPU is counted once."""

from __future__ import annotations

import contextlib
import io
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from herd_operator.cli.main import main
from herd_operator.cli.views import EXIT_USAGE
from herd_operator.simulate.colocation import (
    SIMULATED_SHARING,
    SLOWDOWN_LIMIT,
    interference_slowdown,
    utilization_within,
    with_utilization,
)
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import START_SECONDS, JobModel
from herd_operator.simulate.results import SimResult
from herd_operator.simulate.runner import load_workload, parse_pool, simulate
from herd_operator.simulate.share_report import sharing_table, summarize_sharing
from herd_operator.simulate.workload import perlmutter_mix
from herd_operator.specs import PolicyRef


def small(name: str, arrival: float = 0.0, **changes: object) -> JobModel:
    """A one-GPU job using 20% of its GPU, busy half the time, 1,000 s of work."""
    fields: dict[str, object] = {
        "name": name, "arrival": arrival, "requested": 1, "min_gpus": 1, "max_gpus": 1,
        "work": 1000.0, "epochs": 2, "serial_fraction": 0.0, "mem_fixed": 0.1,
        "mem_batch": 0.1, "gpu_utilization": 0.5,
    }  # fmt: skip
    fields.update(changes)
    return JobModel(**fields)  # type: ignore[arg-type]


def run(jobs: list[JobModel], pool: str = "1x1", **config: object) -> SimResult:
    setting = SimConfig(parse_pool(pool), PolicyRef(name="static"), **config)  # type: ignore[arg-type]
    return Simulation(jobs, setting).run()


def finished(result: SimResult) -> dict[str, float]:
    return {job.name: job.finished for job in result.jobs}


def test_two_small_jobs_share_one_gpu_each_slowed_by_the_model() -> None:
    jobs = [small("a"), small("b")]
    exclusive = finished(run(jobs))
    packed_result = run(jobs, pack=True)
    packed = finished(packed_result)
    # Exclusive: one after the other.
    assert exclusive["a"] == pytest.approx(START_SECONDS + 1000)
    assert exclusive["b"] == pytest.approx(2 * (START_SECONDS + 1000))
    # Packed: together, each slowed by the pair's slowdown (0.5 + 0.5: 1.10).
    slowdown = interference_slowdown((0.5, 0.5))
    assert slowdown == pytest.approx(1.10)
    for name in "ab":
        assert packed[name] == pytest.approx(START_SECONDS + 1000 * slowdown)
    outcome = {job.name: job for job in packed_result.jobs}
    assert outcome["a"].max_slowdown == pytest.approx(slowdown)
    assert outcome["a"].interference == pytest.approx(slowdown)
    # One GPU held the two: counted once.
    summary = summarize_sharing(packed_result)
    assert summary.gpu_hours == pytest.approx((START_SECONDS + 1000 * slowdown) / 3600)
    assert summary.memory_of_allocated == pytest.approx(0.4)
    assert summary.slowed_jobs == 0 and summary.worst_slowdown == pytest.approx(slowdown)


def test_a_neighbour_leaving_speeds_the_job_up_from_then() -> None:
    # b has half a's work: both slowed while together, a alone at full speed after.
    jobs = [small("a"), small("b", work=500.0)]
    packed = finished(run(jobs, pack=True))
    slowdown = interference_slowdown((0.5, 0.5))
    b_end = START_SECONDS + 500 * slowdown
    assert packed["b"] == pytest.approx(b_end)
    assert packed["a"] == pytest.approx(b_end + 500)
    outcome = {job.name: job for job in run(jobs, pack=True).jobs}
    assert outcome["a"].interference == pytest.approx((500 * slowdown + 500) / 1000)


def test_what_does_not_fit_or_does_not_opt_in_waits() -> None:
    # 60% each: two do not fit one GPU's memory.
    big = [small("a", mem_fixed=0.3, mem_batch=0.3), small("b", mem_fixed=0.3, mem_batch=0.3)]
    assert finished(run(big, pack=True))["b"] == pytest.approx(2 * (START_SECONDS + 1000))
    # Busier than the opt-in threshold: whole GPUs.
    busy = [small("a", gpu_utilization=0.9), small("b", gpu_utilization=0.9)]
    result = finished(run(busy, pack=True, share_utilization=0.6))
    assert result["b"] == pytest.approx(2 * (START_SECONDS + 1000))


def _memory_per_gpu(result: SimResult, models: dict[str, JobModel]) -> list[float]:
    """The memory the jobs' model says each GPU holds, at every recorded step."""
    peaks = []
    for _, _, placements in result.steps:
        used: dict[tuple[str, int], float] = defaultdict(float)
        for name, placement in placements.items():
            for slot in placement.slots():
                used[slot] += models[name].memory_fraction(placement.size)
        peaks.append(max(used.values(), default=0.0))
    return peaks


def test_a_mix_under_pack_never_over_commits_and_adds_up() -> None:
    jobs = with_utilization(perlmutter_mix(60, 16, seed=5), 5)
    models = {job.name: job for job in jobs}
    result = run(jobs, pool="4x4", pack=True, record=True)
    assert not result.unfinished and len(result.jobs) == 60
    assert max(_memory_per_gpu(result, models)) <= 1.0 + 1e-9
    # Some GPU held two jobs at once (else this test checks nothing of the sharing).
    assert any(
        len({slot for p in step[2].values() for slot in p.slots()})
        < sum(p.size for p in step[2].values())
        for step in result.steps
    )
    # The timeline never counts more GPUs than the pool.
    assert max(allocated for _, allocated, _ in result.timeline) <= 16
    table = sharing_table([run(jobs, pool="4x4"), result])
    assert table.count("\n") == 4 and "| static |" in table


def test_a_cap_on_summed_utilization_keeps_busy_pairs_apart_and_pairs_a_light_one() -> None:
    cap = utilization_within(SLOWDOWN_LIMIT)
    sharing = replace(SIMULATED_SHARING, max_utilization=cap)
    busy = [small("a", gpu_utilization=0.9), small("b", gpu_utilization=0.9)]
    # Without the cap they share (1.8: each 1.51 times slower); with it, one after the other.
    assert finished(run(busy, pack=True))["b"] == pytest.approx(
        START_SECONDS + 1000 * interference_slowdown((0.9, 0.9))
    )
    assert finished(run(busy, pack=True, sharing=sharing))["b"] == pytest.approx(
        2 * (START_SECONDS + 1000)
    )
    light = [small("a", gpu_utilization=0.9), small("b", gpu_utilization=0.3)]
    slowdown = interference_slowdown((0.9, 0.3))
    assert slowdown <= SLOWDOWN_LIMIT
    assert finished(run(light, pack=True, sharing=sharing))["b"] == pytest.approx(
        START_SECONDS + 1000 * slowdown
    )


def test_a_job_splitting_its_batch_is_admitted_at_the_size_where_its_workers_fit() -> None:
    # b holds 40% of each of two GPUs; a needs 90% of a GPU at its min of 1 but 50% each at 2
    # (its batch split in two): it fits beside b at 2 GPUs at once.
    jobs = [
        small("b", requested=2, min_gpus=2, max_gpus=2, mem_fixed=0.2, mem_batch=0.4,
              work=5000.0),
        small("a", arrival=1.0, requested=2, min_gpus=1, max_gpus=2, mem_fixed=0.1,
              mem_batch=0.8),
    ]  # fmt: skip
    result = run(jobs, pool="1x2", pack=True, record=True)
    models = {job.name: job for job in jobs}
    assert max(_memory_per_gpu(result, models)) <= 1.0 + 1e-9
    admitted = {job.name: job.admitted for job in result.jobs}
    assert admitted["a"] == pytest.approx(1.0)  # not after b's 5,000 s


def test_simulate_takes_the_utilization_cap_and_names_a_bad_one(tmp_path: Path) -> None:
    argv = ["simulate", "perlmutter", "--jobs", "20", "--pool", "4x4", "--output", str(tmp_path)]
    argv += ["--policy", "static+pack", "--share-backfill", "--share-admit-first"]
    argv += ["--share-whole-first", "--max-gpu-utilization"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "1.29"]) == 0
    assert "Co-location" in (tmp_path / "summary.md").read_text()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*argv, "0.5"]) == EXIT_USAGE
    assert "--max-gpu-utilization must be >= 1" in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*argv, "1.29", "--share-shrink-to-admit"]) == EXIT_USAGE
    assert "--share-shrink-to-admit and --share-admit-first: choose one" in err.getvalue()


def test_shrinking_a_sharing_job_admits_a_waiting_one_at_once() -> None:
    # a (elastic, 1-2 GPUs) fills both GPUs of the pool; b (1 GPU, as big) arrives later.
    # Without shrink-to-admit b waits for a to end; with it, a gives one GPU back at b's
    # arrival and b starts once a's worker left it (a's shrink, then a's report frees the
    # drain): no drain stays held past its deadline.
    whole = {"mem_fixed": 0.5, "mem_batch": 0.4, "gpu_utilization": 0.9}
    elastic = small("a", requested=2, max_gpus=2, work=4000.0, **whole)
    waiting = small("b", arrival=100.0, **whole)
    config = {"pack": True, "sharing": replace(SIMULATED_SHARING, shrink_to_admit=True)}
    plain = {job.name: job for job in run([elastic, waiting], "1x2", pack=True).jobs}
    shrunk = {job.name: job for job in run([elastic, waiting], "1x2", **config).jobs}
    assert plain["b"].admitted == pytest.approx(plain["a"].finished)
    assert shrunk["b"].admitted == pytest.approx(100.0, abs=1.0)
    assert shrunk["b"].finished < plain["b"].finished
    assert shrunk["a"].resizes == 2  # shrunk for b, grown again once b ended


def test_a_crowded_gpus_worker_moves_to_a_gpu_that_freed_up_and_runs_unslowed_from_then() -> None:
    # c fills h0:0; a takes h0:1 and b joins it (0.6 + 0.6: slowed 1.20). When c ends, with
    # --share-move-apart a's worker moves to h0:0 (a fresh start of a one-GPU job: its
    # launch stall), and from then neither is slowed; without it they share to the end.
    whole = small("c", work=500.0, mem_fixed=0.5, mem_batch=0.4, gpu_utilization=0.9)
    jobs = [whole, small("a", arrival=1.0, gpu_utilization=0.6)]
    jobs.append(small("b", arrival=2.0, gpu_utilization=0.6))
    limits = replace(SIMULATED_SHARING, whole_first=True, shrink_to_admit=True)
    plain = {job.name: job for job in run(jobs, "1x2", pack=True, sharing=limits).jobs}
    moving = replace(limits, move_apart=True)
    apart = {job.name: job for job in run(jobs, "1x2", pack=True, sharing=moving).jobs}
    assert plain["a"].resizes == 0 and apart["a"].resizes == 1 and apart["b"].resizes == 0
    ended = plain["c"].finished
    assert apart["c"].finished == pytest.approx(ended)
    slowdown = interference_slowdown((0.6, 0.6))
    done_a = (ended - 1.0 - START_SECONDS) / slowdown  # a's work when c ended
    assert apart["a"].finished == pytest.approx(ended + START_SECONDS + 1000.0 - done_a)
    done_b = (ended - 2.0 - START_SECONDS) / slowdown
    assert apart["b"].finished == pytest.approx(ended + 1000.0 - done_b)
    assert apart["a"].finished < plain["a"].finished and apart["b"].finished < plain["b"].finished


def test_simulate_names_share_move_apart_without_shrink_to_admit(tmp_path: Path) -> None:
    argv = ["simulate", "perlmutter", "--jobs", "20", "--pool", "4x4", "--output", str(tmp_path)]
    argv += ["--policy", "static+pack", "--share-to-admit", "--share-light-growth"]
    argv += ["--share-move-apart"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == EXIT_USAGE
    assert "--share-move-apart: only with --share-shrink-to-admit" in err.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--share-shrink-to-admit"]) == 0
    assert "Co-location" in (tmp_path / "summary.md").read_text()


def test_sharing_when_waiting_is_the_elastic_division_until_a_job_waits() -> None:
    """`share_when_waiting` under the division by speedup: while nobody waits (load 0.3), every
    job ends when it ends without sharing, where plain `+pack` grew the sharers in rank order
    and was slower; with a queue (load 1.5), sharing only the waiting jobs' mins beats both."""
    pool = parse_pool("4x4")
    when_waiting = replace(SIMULATED_SHARING, share_when_waiting=True)
    ends: dict[str, list[tuple[str, float]]] = {}
    means: dict[tuple[float, str], float] = {}
    for load in (0.3, 1.5):
        workload = load_workload("perlmutter", pool, 30, 3, load)
        runs = [
            *simulate(workload, pool, ["static+speedup", "static+speedup+pack"], 0.0),
            *simulate(workload, pool, ["static+speedup+pack"], 0.0, sharing=when_waiting),
        ]
        for label, result in zip(("alone", "pack", "when waiting"), runs, strict=True):
            means[load, label] = sum(job.completion for job in result.jobs) / len(result.jobs)
            ends[f"{load} {label}"] = sorted((j.name, round(j.finished, 3)) for j in result.jobs)
    assert ends["0.3 when waiting"] == ends["0.3 alone"]
    assert means[0.3, "pack"] > 1.2 * means[0.3, "alone"]
    assert means[1.5, "when waiting"] < min(means[1.5, "alone"], means[1.5, "pack"])
