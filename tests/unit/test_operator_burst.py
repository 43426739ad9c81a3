"""Tests for herd_operator.operator.reconcile_burst: one allocator decision, grouped commits."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator import operator
from herd_operator import store as store_module
from herd_operator.allocator import Allocator, GrantPublisher
from herd_operator.layout import StateLayout
from herd_operator.store import Store, StoreError
from policies.arbitration import Demand, Grant, Pool

SPEC = '{"gpus": {"min": 1, "max": 1}}'


@pytest.fixture
def layout(tmp_path: Path) -> StateLayout:
    state = StateLayout(tmp_path / "state")
    state.create()
    return state


@pytest.fixture
def store(layout: StateLayout) -> Iterator[Store]:
    with Store(layout.database) as opened:
        yield opened


def test_a_burst_is_decided_once_after_every_job_asked(layout: StateLayout, store: Store) -> None:
    woken: list[str] = []
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}),
        GrantPublisher(layout),
        virtual=True,
        on_change=lambda job, grant: woken.append(job),
    )
    answers: dict[str, Grant | None] = {}

    def ask(name: str) -> None:
        answers[name] = allocator.request(Demand(name, 1, 1, 1, arrival=float(len(answers))))

    operator.reconcile_burst(["a", "b", "c"], allocator, store, ask)

    assert answers == {"a": None, "b": None, "c": None}  # nobody decided alone
    assert sorted(woken) == ["a", "b", "c"]  # each is woken to act on the one decision
    sizes = {name: placement.size for name, placement in allocator.placements().items()}
    assert sizes == {"a": 1, "b": 1, "c": 0}  # first come, first served on 2 GPUs


@pytest.mark.parametrize(
    ("group_seconds", "seen_by_others"),
    [
        (3600.0, [[], [], []]),  # one group: nothing visible before the end
        (0.0, [[], ["j0"], ["j0", "j1"]]),  # a commit after every job
    ],
)
def test_a_burst_commits_its_writes_in_groups(
    layout: StateLayout,
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    group_seconds: float,
    seen_by_others: list[list[str]],
) -> None:
    monkeypatch.setattr(operator, "STORE_GROUP_SECONDS", group_seconds)
    allocator = Allocator(Pool.from_counts({"localhost": 1}), GrantPublisher(layout), virtual=True)
    seen: list[list[str]] = []
    with Store.open_readonly(store.path) as reader:

        def record(name: str) -> None:
            seen.append([job.name for job in reader.list_jobs()])
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)

        operator.reconcile_burst(["j0", "j1", "j2"], allocator, store, record)

        assert seen == seen_by_others
        assert [job.name for job in reader.list_jobs()] == ["j0", "j1", "j2"]


def test_a_failing_job_leaves_the_writes_before_it_and_ends_the_batch(
    layout: StateLayout, store: Store
) -> None:
    allocator = Allocator(Pool.from_counts({"localhost": 1}), GrantPublisher(layout), virtual=True)

    def record(name: str) -> None:
        if name == "bad":
            raise RuntimeError("reconcile bug")
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        allocator.request(Demand(name, 1, 1, 1))

    with pytest.raises(RuntimeError, match="reconcile bug"):
        operator.reconcile_burst(["ok", "bad", "never"], allocator, store, record)

    assert [job.name for job in store.list_jobs()] == ["ok"]
    grant = allocator.grant("ok")  # the batch still decided on the way out
    assert grant is not None and grant.placement.size == 1
    assert allocator.request(Demand("later", 1, 1, 1)) is not None  # not batching any more


def test_a_group_the_store_cannot_begin_is_handed_back(
    layout: StateLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 50)
    allocator = Allocator(Pool.from_counts({"localhost": 1}), GrantPublisher(layout), virtual=True)
    processed: list[str] = []
    with Store(layout.database) as store:
        # Another process holds the write lock: our group cannot even begin.
        other = sqlite3.connect(layout.database, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            lost = operator.reconcile_burst(["a", "b"], allocator, store, processed.append)
            assert (lost, processed) == (["a", "b"], [])
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert operator.reconcile_burst(["a", "b"], allocator, store, processed.append) == []
        assert processed == ["a", "b"]


def test_a_store_error_raised_by_a_job_is_not_taken_for_a_failed_commit(
    layout: StateLayout, store: Store
) -> None:
    allocator = Allocator(Pool.from_counts({"localhost": 1}), GrantPublisher(layout), virtual=True)

    def broken(name: str) -> None:
        raise StoreError(f"{name}: cannot write")

    with pytest.raises(StoreError, match=r"^a: cannot write$"):
        operator.reconcile_burst(["a", "b"], allocator, store, broken)
