"""`history`: what the bounds on a long allocation's state cost and save.

A synthetic long history: 10,000 jobs (1,000 with --quick) with 100 grant changes each,
half of them deleted long ago. Three rows, each against a baseline measured in the same run:

- the store's size after the prune of the deleted half, against the same store unpruned;
- the longest time one step of the incremental prune holds the store (the loop and the RPC
  thread wait that long at most), against deleting the same rows in one transaction;
- `add_grant_change` on a job at the bound (it drops one row per insert), against the same
  insert without a bound.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import time
from pathlib import Path

from herd_operator.bench.harness import Context, Row, Stats
from herd_operator.runtime.store import MAX_GRANTS_PER_JOB, Store
from herd_operator.specs import HerdJob

GRANTS_PER_JOB = 100
OLD = 1_000.0
"""When the deleted jobs' last grant changed (unix seconds: long before the cutoff)."""


def _spec(name: str) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python"], "gpus": {"min": 1, "max": 4}},
        }
    )


def build(path: Path, jobs: int) -> None:
    """Every job with GRANTS_PER_JOB changes; the odd ones deleted (no record)."""
    with Store(path) as store:
        spec = _spec("template")
        with store.transaction():
            for n in range(0, jobs, 2):
                name = f"job-{n:05d}"
                store.record_spec(name, f"{name}.yaml", spec.model_copy(), name, 1.0)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executemany(
            "INSERT INTO grant_history (job, time, gpus, reason) VALUES (?, ?, ?, ?)",
            (
                (f"job-{n:05d}", OLD + step, 1 + step % 4, "resized: memory 0.2 < 0.3")
                for n in range(jobs)
                for step in range(GRANTS_PER_JOB)
            ),
        )
        conn.commit()


def used_bytes(path: Path) -> int:
    """Pages in use (SQLite reuses freed pages rather than shrinking the file)."""
    with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    return int((pages - free) * size)


def prune_steps(path: Path) -> tuple[list[float], float, int]:
    """The incremental prune: each step's seconds, the whole walk's, the jobs pruned."""
    steps: list[float] = []
    pruned = 0
    with Store(path) as store:
        started = time.perf_counter()
        after: str | None = ""
        while after is not None:
            step = time.perf_counter()
            names, after = store.prune_deleted_history(OLD + 10 * GRANTS_PER_JOB, after)
            steps.append(time.perf_counter() - step)
            pruned += len(names)
        return steps, time.perf_counter() - started, pruned


def prune_at_once(path: Path) -> float:
    """The same rows deleted in one transaction: the lock hold a naive prune would have."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "DELETE FROM grant_history WHERE job NOT IN (SELECT name FROM jobs) AND job IN"
            " (SELECT job FROM grant_history GROUP BY job HAVING max(time) < ?)",
            (OLD + 10 * GRANTS_PER_JOB,),
        )
        conn.execute("COMMIT")
        return time.perf_counter() - started


def insert_costs(path: Path, bound: int, inserts: int) -> list[float]:
    """Seconds per add_grant_change of a job that already has MAX_GRANTS_PER_JOB changes,
    in a store that keeps `bound` per job."""
    with Store(path, max_grants_per_job=bound) as store:
        with store.transaction():
            for step in range(MAX_GRANTS_PER_JOB):
                store.add_grant_change("steady", 1 + step % 4, "resized", float(step))
        costs = []
        for step in range(inserts):
            started = time.perf_counter()
            store.add_grant_change("steady", 1 + step % 4, "resized", float(10**6 + step))
            costs.append(time.perf_counter() - started)
        return costs


def run_history(ctx: Context) -> list[Row]:
    jobs = 1_000 if ctx.quick else 10_000
    template = ctx.scratch / "history-template.db"
    ctx.progress(f"history: building {jobs} jobs x {GRANTS_PER_JOB} grant changes")
    build(template, jobs)
    unpruned = used_bytes(template)
    sizes: list[float] = []
    step_ms: list[float] = []
    median_step_ms: list[float] = []
    walks: list[float] = []
    at_once_ms: list[float] = []
    for attempt in range(ctx.repeat):  # alternate: ours, then the baseline, on fresh copies
        ours = ctx.scratch / f"history-ours-{attempt}.db"
        shutil.copyfile(template, ours)
        steps, walk, pruned = prune_steps(ours)
        sizes.append(used_bytes(ours) / 1e6)
        step_ms.append(max(steps) * 1000)
        median_step_ms.append(Stats.of(steps).median * 1000)
        walks.append(walk)
        baseline = ctx.scratch / f"history-base-{attempt}.db"
        shutil.copyfile(template, baseline)
        at_once_ms.append(prune_at_once(baseline) * 1000)
        ctx.progress(
            f"history: pruned {pruned} jobs in {len(steps)} steps, {walk:.2f} s;"
            f" longest step {max(steps) * 1000:.1f} ms, at once {at_once_ms[-1]:.0f} ms"
        )
        ours.unlink()
        baseline.unlink()
    bounded: list[float] = []
    unbounded: list[float] = []
    for attempt in range(ctx.repeat):
        bounded += insert_costs(
            ctx.scratch / f"insert-bounded-{attempt}.db", MAX_GRANTS_PER_JOB, 200
        )
        unbounded += insert_costs(ctx.scratch / f"insert-unbounded-{attempt}.db", 10**9, 200)
    return [
        Row(
            name="history: store size after the prune",
            what=f"{jobs} jobs x {GRANTS_PER_JOB} grant changes, half deleted long ago (pages"
            " in use: SQLite reuses the freed space for new rows; the file does not shrink)",
            unit="MB",
            better="lower",
            baseline_label="the same store unpruned",
            baseline=Stats.of([unpruned / 1e6] * len(sizes)),
            ours=Stats.of(sizes),
            extra={"prune_walk_s": Stats.of(walks).median},
        ),
        Row(
            name="history: longest store hold of the prune",
            what="the longest step of the incremental prune (the loop waits at most this)",
            unit="ms",
            better="lower",
            baseline_label="the same rows deleted in one transaction",
            baseline=Stats.of(at_once_ms),
            ours=Stats.of(step_ms),
            extra={"median_step_ms": Stats.of(median_step_ms).median},
        ),
        Row(
            name="history: add_grant_change at the bound",
            what=f"a job with {MAX_GRANTS_PER_JOB} changes, each insert dropping the oldest",
            unit="us",
            better="lower",
            baseline_label="the same insert, unbounded",
            baseline=Stats.of([s * 1e6 for s in unbounded]),
            ours=Stats.of([s * 1e6 for s in bounded]),
        ),
    ]
