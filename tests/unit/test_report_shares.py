"""`herd-operator report` shows shared GPUs (issue 30): which jobs held each GPU together and
the memory each job's worker was counted for, from the store's log of them (schema 6); a
store from before the log still reports, with no shared GPUs."""

from __future__ import annotations

import csv
import io
import itertools
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.cli.report.figure_data import pool_stack
from herd_operator.cli.report.series import job_sources, load_run
from herd_operator.cli.report.shares import LANE_HEIGHT, SharedSpan, share_bars, shared_spans
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.runtime.store.shares import ShareChange
from herd_operator.specs.values import Placement
from tests.unit.test_report import GIB, T0, add_job, read_png, run_cli, spec_json, two_jobs

EXIT_OK = 0


def on(gpu: int, time: float, *jobs: tuple[str, int]) -> ShareChange:
    return ShareChange(time, "h", gpu, jobs)


# ---- the pure part: logged rows -> spans -> bars ----


def test_spans_are_the_times_a_gpu_held_two_jobs_or_more() -> None:
    changes = [
        on(0, 100.0, ("a", 2 * GIB)),  # alone: not shared
        on(0, 110.0, ("a", 2 * GIB), ("b", 3 * GIB)),
        on(1, 115.0, ("c", GIB), ("d", 0)),  # d's memory not known
        on(0, 150.0, ("a", 4 * GIB), ("b", 3 * GIB)),  # a measured anew
        on(0, 180.0),  # both gone
    ]
    spans = shared_spans(changes, origin=100.0, end=200.0)
    assert spans == (
        SharedSpan("h:0", 10.0, 50.0, (("a", 2 * GIB), ("b", 3 * GIB))),
        SharedSpan("h:0", 50.0, 80.0, (("a", 4 * GIB), ("b", 3 * GIB))),
        SharedSpan("h:1", 15.0, 200.0, (("c", GIB), ("d", 0))),  # held to the end
    )
    assert spans[0].label() == "a 2.0Gi, b 3.0Gi"
    assert spans[2].label() == "c 1.0Gi, d ?"
    # A window starting later: what was in force then starts at 0; --jobs keeps the GPUs
    # of the jobs named, with their neighbours.
    assert shared_spans(changes, origin=160.0, end=40.0) == (
        SharedSpan("h:0", 0.0, 20.0, (("a", 4 * GIB), ("b", 3 * GIB))),
        SharedSpan("h:1", 0.0, 40.0, (("c", GIB), ("d", 0))),
    )
    assert [span.gpu for span in shared_spans(changes, 100.0, 200.0, {"d"})] == ["h:1"]
    assert shared_spans([], 0.0, 10.0) == ()


def test_bars_stack_each_gpus_jobs_by_memory_to_one_scale() -> None:
    spans = (
        SharedSpan("h:0", 0.0, 40.0, (("a", 2 * GIB), ("b", 6 * GIB))),
        SharedSpan("h:1", 10.0, 30.0, (("c", GIB), ("d", 3 * GIB))),
    )
    lanes, bars = share_bars(spans)
    assert lanes == ["h:0", "h:1"]
    # The fullest span (8 GiB) fills LANE_HEIGHT; the other is drawn to the same scale.
    a, b, c, d = bars
    assert (a.lane, a.start, a.width, a.bottom) == (0, 0.0, 40.0, 0.0)
    assert a.height == pytest.approx(LANE_HEIGHT / 4)
    assert b.bottom == pytest.approx(LANE_HEIGHT / 4) and b.height == pytest.approx(
        LANE_HEIGHT * 3 / 4
    )
    assert (c.lane, c.bottom, d.bottom) == (1, 1.0, pytest.approx(1.0 + LANE_HEIGHT / 8))
    assert c.height + d.height == pytest.approx(LANE_HEIGHT / 2)
    assert [bar.text for bar in bars] == ["a 2.0Gi", "b 6.0Gi", "c 1.0Gi", "d 3.0Gi"]
    # Memory not known for a job: every job counts alike (a bar each, none of height 0).
    _, alike = share_bars((SharedSpan("h:0", 0.0, 1.0, (("a", GIB), ("b", 0))),))
    assert [bar.height for bar in alike] == [LANE_HEIGHT / 2, LANE_HEIGHT / 2]


_changes = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.integers(0, 100),
        st.lists(st.sampled_from("abcd"), unique=True, max_size=4),
    ),
    max_size=12,
).map(
    lambda rows: [
        on(gpu, float(time), *((job, GIB) for job in sorted(jobs)))
        for gpu, time, jobs in sorted(rows, key=lambda row: row[1])
    ]
)


@given(_changes, st.integers(0, 50), st.integers(0, 100))
def test_spans_cover_exactly_the_time_a_gpu_was_shared(
    changes: list[ShareChange], origin: int, end: int
) -> None:
    spans = shared_spans(changes, float(origin), float(end))
    for index in range(3):
        mine = [span for span in spans if span.gpu == f"h:{index}"]
        # In order, apart, within the window, each of two jobs or more.
        assert all(0.0 <= s.start <= s.end <= end and len(s.jobs) >= 2 for s in mine)
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))
        # At each whole second, shared in a span iff the last change by then had two jobs.
        logged = [change for change in changes if change.gpu == index]
        for second in range(end):
            at = origin + second + 0.5
            state = [change for change in logged if change.time <= at]
            shared = bool(state) and len(state[-1].jobs) >= 2
            inside = any(s.start <= second + 0.5 < s.end for s in mine)
            assert inside == shared, (second, state, mine)


# ---- through the real store ----


def share_alpha_and_beta(state: Path) -> None:
    """alpha and beta share GPU h:0 from T0+130 to T0+300 (alpha's end)."""
    with Store(StateLayout(state).database) as store:
        both = {"alpha": Placement((("h", (0,)),)), "beta": Placement((("h", (0, 1)),))}
        store.replace_allocations({"alpha": Placement((("h", (0,)),))}, T0 + 10, shared={"alpha"})
        unchanged = store.share_history()
        store.replace_allocations(
            {"alpha": Placement((("h", (0,)),))}, T0 + 20, shared={"alpha"}, memory={}
        )
        assert store.share_history() == unchanged, "an unchanged GPU is not logged again"
        store.replace_allocations(
            both, T0 + 130, shared={"alpha", "beta"}, memory={"alpha": 2 * GIB, "beta": 3 * GIB}
        )
        # A restarted operator's adopted job, memory not known yet: what was logged stands.
        store.replace_allocations(
            both, T0 + 140, shared={"alpha", "beta"}, memory={"beta": 3 * GIB}
        )
        store.replace_allocations(
            {"beta": Placement((("h", (0, 1)),))},
            T0 + 300,
            shared={"beta"},
            memory={"beta": 3 * GIB},
        )
        assert store.share_history() == [
            ShareChange(T0 + 10, "h", 0, (("alpha", 0),)),
            ShareChange(T0 + 130, "h", 0, (("alpha", 2 * GIB), ("beta", 3 * GIB))),
            ShareChange(T0 + 130, "h", 1, (("beta", 3 * GIB),)),
            ShareChange(T0 + 300, "h", 0, (("beta", 3 * GIB),)),
        ]


def test_the_report_shows_which_jobs_shared_a_gpu_and_their_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = two_jobs(tmp_path / "state")
    share_alpha_and_beta(state)
    base = ("report", "--state-dir", str(state))
    code, text, err = run_cli(capsys, *base, "--format", "text")
    assert code == EXIT_OK, err
    shared = text.split("Shared GPUs:")[1].strip().splitlines()
    assert shared[1].split() == ["h:0", "2m10s", "5m00s", "alpha", "2.0Gi,", "beta", "3.0Gi"]
    assert len(shared) == 2
    code, out, err = run_cli(capsys, *base, "--format", "json")
    assert json.loads(out)["sharedGpus"] == [
        {
            "gpu": "h:0",
            "fromOffsetSeconds": 130.0,
            "toOffsetSeconds": 300.0,
            "jobs": [
                {"job": "alpha", "memoryBytes": 2 * GIB},
                {"job": "beta", "memoryBytes": 3 * GIB},
            ],
        }
    ]
    code, out, err = run_cli(capsys, *base, "--format", "csv")
    rows = {row["job"]: row for row in csv.DictReader(io.StringIO(out))}
    assert (rows["alpha"]["shared_with"], rows["alpha"]["shared_memory_bytes"]) == (
        "beta",
        str(2 * GIB),
    )
    assert (rows["beta"]["shared_with"], rows["beta"]["shared_memory_bytes"]) == (
        "alpha",
        str(3 * GIB),
    )
    figure = tmp_path / "timeline.png"
    code, _, err = run_cli(capsys, *base, "--output", str(figure))
    assert code == EXIT_OK, err
    assert read_png(figure) == (1200, 1350)


def test_a_state_dir_from_before_the_log_still_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = two_jobs(tmp_path / "state")
    database = StateLayout(state).database
    raw = sqlite3.connect(database)
    try:  # as an operator of schema 5 left it: no log of shared GPUs
        raw.execute("DROP TABLE share_history")
        raw.execute("ALTER TABLE reports DROP COLUMN measurement")  # schema 7's
        raw.execute("PRAGMA user_version = 5")
        raw.commit()
    finally:
        raw.close()
    base = ("report", "--state-dir", str(state))
    code, text, err = run_cli(capsys, *base, "--format", "text")
    assert code == EXIT_OK, err
    assert "Shared GPUs" not in text and "Grant changes:" in text
    code, out, err = run_cli(capsys, *base, "--format", "json")
    assert code == EXIT_OK, err
    assert json.loads(out)["sharedGpus"] == []
    # The operator migrates it; the time before the migration has nothing to show.
    with Store(database) as store:
        assert store.share_history() == []
    share_alpha_and_beta(state)
    code, out, err = run_cli(capsys, *base, "--format", "json")
    assert [span["gpu"] for span in json.loads(out)["sharedGpus"]] == ["h:0"]


# ---- the pool panel counts a shared GPU once ----


def test_the_pool_stack_splits_a_shared_gpu_by_memory_and_never_exceeds_the_pool(
    tmp_path: Path,
) -> None:
    """alpha holds h:0 alone, then beta comes on h:0 (beside alpha) and h:1: three grants on
    a pool of two GPUs. The stack gives each job its memory's part of h:0, so beta shows
    whole, where stacking the grants hid half of it above the pool."""
    state = tmp_path / "state"
    with Store(StateLayout(state).database) as store:
        store.record_pool_size(2, T0)
        add_job(store, "alpha", spec_json("alpha", 1, 1), T0, "Running", T0 + 100)
        add_job(store, "beta", spec_json("beta", 2, 2), T0, "Running", T0 + 100)
        store.add_grant_change("alpha", 1, "admitted", T0 + 10)
        alone = {"alpha": Placement((("h", (0,)),))}
        store.replace_allocations(alone, T0 + 10, shared={"alpha"}, memory={"alpha": 2 * GIB})
        store.add_grant_change("beta", 2, "admitted", T0 + 20)
        both = {**alone, "beta": Placement((("h", (0, 1)),))}
        memory = {"alpha": 2 * GIB, "beta": 3 * GIB}
        store.replace_allocations(both, T0 + 20, shared={"alpha", "beta"}, memory=memory)
        store.add_report("alpha", 0, 1, 0, {}, T0 + 90)
        with store.snapshot():
            run = load_run(store, state, job_sources(store), since=None)
    stack = pool_stack(run)
    names = [job.name for job in run.jobs]
    at = stack.times.index(20.0)
    parts = dict(zip(names, (levels[at] for levels in stack.granted), strict=True))
    assert parts == pytest.approx({"alpha": 0.4, "beta": 1.6})  # h:0 split 2:3, h:1 beta's
    assert stack.idle[at] == pytest.approx(0.0)
    before = stack.times.index(10.0)
    alpha_alone = dict(zip(names, (levels[before] for levels in stack.granted), strict=True))
    assert alpha_alone == {"alpha": 1, "beta": 0}  # a GPU held alone counts whole
    for index, size in enumerate(stack.pool):
        held = sum(levels[index] for levels in stack.granted)
        assert held + stack.draining[index] + stack.idle[index] == pytest.approx(size)
