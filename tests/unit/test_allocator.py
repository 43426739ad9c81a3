"""The allocator: grants published as files, change callbacks, and worker binding."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from herd_operator.controllers.ports import Workers
from herd_operator.environment import (
    GPU_ENV,
    JOB_ENV,
    LAUNCH_ID_ENV,
    STATE_DIR_ENV,
    WORKER_HOST_ENV,
)
from herd_operator.exporters.gpu import process_tree_rss
from herd_operator.layout import StateLayout
from herd_operator.rpc.protocol import BadRequest, NotFound
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import slots_to_give_up
from herd_operator.runtime.engines import torchrun
from herd_operator.runtime.engines.horovod import GrantPublisher, present
from herd_operator.runtime.handlers import AllocatorOps
from herd_operator.runtime.process_table import (
    agent_names,
    alive,
    is_process_of_job,
    started_since,
)
from herd_operator.specs.values import Allocation, Demand, Grant, Placement, Pool

# Hang guard for running a discovery script; never a performance expectation.
GUARD_S = 10.0


def any_pid(job: str, pid: int) -> bool:
    """Binding mechanics are tested apart from the pid check (its own tests below): every
    pid counts as a process of the job."""
    return True


class Recorder:
    """Collects the allocator's callbacks."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, Grant]] = []
        self.decisions: list[dict[str, Placement]] = []

    def on_change(self, job: str, grant: Grant) -> None:
        self.changes.append((job, grant))

    def on_decision(self, decision: Allocation) -> None:
        self.decisions.append(dict(decision.placements))


@pytest.fixture
def layout(tmp_path: Path) -> StateLayout:
    layout = StateLayout(tmp_path / "state")
    layout.create()
    return layout


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def allocator(layout: StateLayout, recorder: Recorder) -> Allocator:
    # Given-back GPUs are free at once here; the draining tests at the end build their own.
    made = Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout),
        virtual=True,
        on_decision=recorder.on_decision,
        drain_seconds=0,
        belongs=any_pid,
    )
    made.watch(recorder.on_change)
    return made


def demand(name: str, low: int, high: int, desired: int | None = None) -> Demand:
    return Demand(name, low, high, high if desired is None else desired)


def run_discovery(script: Path) -> str:
    done = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=GUARD_S, check=True
    )
    assert done.stderr == ""
    return done.stdout


def test_request_publishes_the_grant_and_the_script_prints_it(
    allocator: Allocator, layout: StateLayout
) -> None:
    grant = allocator.request(demand("a", 1, 4))
    assert grant.placement == Placement((("localhost", (0, 1, 2, 3)),))
    assert layout.grant_file("a").read_text() == "localhost:4\n"
    script = GrantPublisher(layout).discovery_script("a")
    assert script == layout.discovery_script("a")
    # A shell `cat`, not a Python start-up: Horovod runs it every second.
    grant_path = shlex.quote(str(layout.grant_file("a").resolve()))
    assert script.read_text() == f"#!/bin/sh\nexec cat {grant_path}\n"
    assert run_discovery(script) == "localhost:4\n"


def test_multi_host_grant_lists_every_host(layout: StateLayout) -> None:
    allocator = Allocator(
        Pool.from_counts({"nid001": 2, "nid002": 2}),
        GrantPublisher(layout),
        virtual=False,
        belongs=any_pid,
    )
    allocator.request(demand("a", 3, 3))
    script = GrantPublisher(layout).discovery_script("a")
    assert run_discovery(script) == "nid001:2\nnid002:1\n"


def test_shrink_rewrites_the_file_and_tells_only_the_other_job(
    allocator: Allocator, layout: StateLayout, recorder: Recorder
) -> None:
    allocator.request(demand("a", 1, 4))
    script = GrantPublisher(layout).discovery_script("a")
    assert recorder.changes == []  # the caller learns its grant from the return value

    grant_b = allocator.request(demand("b", 2, 2))
    assert grant_b.placement == Placement((("localhost", (2, 3)),))
    assert layout.grant_file("b").read_text() == "localhost:2\n"
    assert [job for job, _ in recorder.changes] == ["a"]
    grant_a = recorder.changes[0][1]
    # Shrunk from the tail: the surviving workers keep their GPUs.
    assert grant_a.placement == Placement((("localhost", (0, 1)),))
    assert grant_a == allocator.grant("a")
    assert layout.grant_file("a").read_text() == "localhost:2\n"
    assert run_discovery(script) == "localhost:2\n"
    assert recorder.decisions[-1] == {
        "a": Placement((("localhost", (0, 1)),)),
        "b": Placement((("localhost", (2, 3)),)),
    }


def test_unchanged_demand_decides_nothing(allocator: Allocator, recorder: Recorder) -> None:
    first = allocator.request(demand("a", 1, 4))
    decisions = len(recorder.decisions)
    assert allocator.request(demand("a", 1, 4)) == first
    assert len(recorder.decisions) == decisions


def test_release_removes_files_and_frees_gpus_for_the_next(
    allocator: Allocator, layout: StateLayout, recorder: Recorder
) -> None:
    allocator.request(demand("a", 4, 4))
    GrantPublisher(layout).discovery_script("a")
    pending = allocator.request(demand("b", 1, 2))
    assert not pending.admitted
    assert pending.reason == "pending: needs 1 GPU, 0 free"
    assert not layout.grant_file("b").exists()

    allocator.release("a")
    assert not layout.grant_file("a").exists()
    assert not layout.discovery_script("a").exists()
    assert allocator.grant("a") is None
    assert [job for job, _ in recorder.changes] == ["b"]
    assert recorder.changes[0][1].placement == Placement((("localhost", (0, 1)),))
    assert layout.grant_file("b").read_text() == "localhost:2\n"

    grant_c = allocator.request(demand("c", 2, 2))
    assert grant_c.placement == Placement((("localhost", (2, 3)),))


def test_release_of_an_unknown_job_does_nothing(allocator: Allocator, recorder: Recorder) -> None:
    allocator.release("ghost")
    assert recorder.decisions == []


def test_handle_bind_answers_by_local_rank(allocator: Allocator) -> None:
    allocator.request(demand("x", 1, 1))
    allocator.request(demand("a", 3, 3))
    reply = AllocatorOps(allocator).bind(
        {"job": "a", "host": "localhost", "local_rank": 1, "pid": 77}
    )
    assert reply == {"gpu": 2, "gpus": [1, 2, 3], "virtual": True}
    (binding,) = allocator.bindings()
    assert (binding.job, binding.host, binding.local_rank, binding.gpu, binding.pid) == (
        "a",
        "localhost",
        1,
        2,
        77,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"job": "a", "host": "localhost", "local_rank": 2},
            "job 'a' holds 2 GPU(s) on 'localhost'; no local rank 2",
        ),
        (
            {"job": "a", "host": "nid009", "local_rank": 0},
            "job 'a' holds 0 GPU(s) on 'nid009'; no local rank 0",
        ),
        ({"job": "ghost", "host": "localhost", "local_rank": 0}, "job 'ghost' holds no GPUs"),
        ({"job": "waiting", "host": "localhost", "local_rank": 0}, "job 'waiting' holds no GPUs"),
    ],
)
def test_handle_bind_not_found(allocator: Allocator, args: dict[str, object], message: str) -> None:
    allocator.request(demand("a", 2, 2))
    allocator.request(demand("b", 2, 2))
    allocator.request(demand("waiting", 1, 1))
    with pytest.raises(NotFound) as caught:
        AllocatorOps(allocator).bind(args)
    assert str(caught.value) == message
    assert allocator.bindings() == []


BAD_HOST = (
    "'host' must be a host name or IP address (letters, digits, '.', '-', '_', ':', '%';"
    " at most 253 characters)"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"host": "localhost", "local_rank": 0}, "'job' must be a non-empty string"),
        ({"job": "", "host": "localhost", "local_rank": 0}, "'job' must be a non-empty string"),
        ({"job": "a", "host": 3, "local_rank": 0}, BAD_HOST),
        ({"job": "a", "host": "localhost\nforged", "local_rank": 0}, BAD_HOST),
        ({"job": "a", "host": "localhost"}, "'local_rank' must be an integer from 0 to 65535"),
        (
            {"job": "a", "host": "localhost", "local_rank": -1},
            "'local_rank' must be an integer from 0 to 65535",
        ),
        (
            {"job": "a", "host": "localhost", "local_rank": True},
            "'local_rank' must be an integer from 0 to 65535",
        ),
        (
            {"job": "a", "host": "localhost", "local_rank": "0"},
            "'local_rank' must be an integer from 0 to 65535",
        ),
    ],
)
def test_handle_bind_bad_request(
    allocator: Allocator, args: dict[str, object], message: str
) -> None:
    allocator.request(demand("a", 2, 2))
    with pytest.raises(BadRequest) as caught:
        AllocatorOps(allocator).bind(args)
    assert str(caught.value) == message


def test_shrink_drops_bindings_of_ranks_no_longer_granted(allocator: Allocator) -> None:
    allocator.request(demand("a", 1, 4))
    for rank in range(4):
        AllocatorOps(allocator).bind({"job": "a", "host": "localhost", "local_rank": rank})
    allocator.request(demand("b", 3, 3))
    assert sorted(b.local_rank for b in allocator.bindings()) == [0]


def test_release_all_clears_everything(
    allocator: Allocator, layout: StateLayout, recorder: Recorder
) -> None:
    allocator.request(demand("a", 2, 2))
    allocator.request(demand("b", 2, 2))
    publisher = GrantPublisher(layout)
    publisher.discovery_script("a")
    publisher.discovery_script("b")
    AllocatorOps(allocator).bind({"job": "a", "host": "localhost", "local_rank": 0})

    allocator.release_all()
    assert allocator.placements() == {}
    assert allocator.grant("a") is None and allocator.grant("b") is None
    assert allocator.bindings() == []
    assert recorder.decisions[-1] == {}
    assert sorted(path.name for path in layout.grants_dir.iterdir()) == []
    # The whole pool is free again.
    assert allocator.request(demand("c", 4, 4)).placement.size == 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def draining_allocator(layout: StateLayout, recorder: Recorder, clock: Clock) -> Allocator:
    made = Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=30.0,
        clock=clock,
        belongs=any_pid,
    )
    made.watch(recorder.on_change)
    return made


def test_gpus_taken_from_a_job_drain_until_its_workers_report_the_new_size(
    layout: StateLayout, recorder: Recorder
) -> None:
    clock = Clock()
    allocator = draining_allocator(layout, recorder, clock)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    grant_b = allocator.request(Demand("b", 2, 2, 2, arrival=2))
    assert allocator.grant("a") is not None and allocator.grant("a").placement.size == 2  # type: ignore[union-attr]
    assert not grant_b.admitted, "b must not land on GPUs a's workers may still use"
    assert grant_b.reason == (
        "pending: waiting for GPUs that a gave back to drain (its workers leave them first)"
    )
    assert allocator.draining() == {("localhost", 2): "a", ("localhost", 3): "a"}

    allocator.observe_world_size("a", 3)  # still shrinking: nothing changes
    assert not allocator.grant("b").admitted  # type: ignore[union-attr]

    allocator.observe_world_size("a", 2)
    assert allocator.draining() == {}
    grant = allocator.grant("b")
    assert grant is not None and grant.placement.slots() == (("localhost", 2), ("localhost", 3))
    assert ("b", grant) in recorder.changes, "the waiting job is woken"


class Events:
    def __init__(self) -> None:
        self.raised: list[tuple[str, str, str, str]] = []

    def __call__(self, job: str, type: str, reason: str, message: str) -> None:
        self.raised.append((job, type, reason, message))


def test_a_drain_past_its_timeout_warns_once_and_keeps_the_gpus(
    layout: StateLayout, recorder: Recorder
) -> None:
    """A timeout alone never hands a GPU over: the job's worker may still be on it."""
    clock = Clock()
    events = Events()
    allocator = Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=30.0,
        on_event=events,
        clock=clock,
        belongs=any_pid,
    )
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    allocator.request(Demand("b", 2, 2, 2, arrival=2))
    clock.now += 29
    assert not allocator.request(Demand("b", 2, 2, 2, arrival=2)).admitted
    assert events.raised == [] and allocator.overdue_drains() == 0
    clock.now += 2
    assert not allocator.request(Demand("b", 2, 2, 2, arrival=2)).admitted
    assert allocator.draining() == {("localhost", 2): "a", ("localhost", 3): "a"}
    assert allocator.overdue_drains() == 2
    assert [(job, type, reason) for job, type, reason, _ in events.raised] == [
        ("a", "Warning", "DrainOverdue"),
        ("a", "Warning", "DrainOverdue"),
    ]
    assert "GPU localhost:2 given back 30s ago is still draining" in events.raised[0][3]
    clock.now += 600
    assert not allocator.request(Demand("b", 2, 2, 2, arrival=2)).admitted
    assert len(events.raised) == 2, "said once per GPU"

    allocator.observe_world_size("a", 2)  # observed: the shrink is done
    assert allocator.grant("b").admitted  # type: ignore[union-attr]
    assert allocator.overdue_drains() == 0


def test_a_drain_ends_when_the_bound_workers_are_gone(
    layout: StateLayout, recorder: Recorder
) -> None:
    clock = Clock()
    allocator = draining_allocator(layout, recorder, clock)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    worker = subprocess.Popen(["sleep", "60"])
    try:
        AllocatorOps(allocator).bind(
            {"job": "a", "host": "localhost", "local_rank": 3, "pid": worker.pid}
        )
        allocator.request(Demand("b", 1, 1, 1, arrival=2))  # a: 4 -> 3, GPU 3 drains
        assert allocator.draining() == {("localhost", 3): "a"}
        assert not allocator.request(Demand("b", 1, 1, 1, arrival=2)).admitted
    finally:
        worker.kill()
        worker.wait()
    clock.now += 1.0  # workers are looked for at most once a second
    assert allocator.request(Demand("b", 1, 1, 1, arrival=2)).placement.slots() == (
        ("localhost", 3),
    )


def test_a_released_job_frees_its_draining_gpus_at_once(
    layout: StateLayout, recorder: Recorder
) -> None:
    clock = Clock()
    allocator = draining_allocator(layout, recorder, clock)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    allocator.request(Demand("b", 3, 3, 3, arrival=2))  # a: 4 -> 1, three GPUs drain
    assert not allocator.grant("b").admitted  # type: ignore[union-attr]
    allocator.release("a")  # its processes are gone
    grant = allocator.grant("b")
    assert grant is not None and grant.placement.size == 3
    assert allocator.draining() == {}


# ---- one host under several names (the Horovod engine's presentation) ----

NAMES = {"localhost": ("localhost", "127.0.0.1")}


def named_allocator(layout: StateLayout, **kwargs: Any) -> Allocator:
    return Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout, NAMES),
        virtual=True,
        present=lambda job, placement: present(placement, NAMES),
        drain_seconds=0,
        **kwargs,
        belongs=any_pid,
    )


def test_a_worker_binds_to_the_gpu_shown_under_its_host_name(layout: StateLayout) -> None:
    allocator = named_allocator(layout)
    allocator.request(demand("a", 1, 4))
    assert layout.grant_file("a").read_text() == "localhost:2\n127.0.0.1:2\n"
    reply = AllocatorOps(allocator).bind(
        {"job": "a", "host": "127.0.0.1", "local_rank": 1, "pid": 9}
    )
    assert reply == {"gpu": 3, "gpus": [1, 3], "virtual": True}
    reply = AllocatorOps(allocator).bind({"job": "a", "host": "localhost", "local_rank": 1})
    assert reply["gpu"] == 2
    bindings = {(b.name, b.local_rank): (b.host, b.gpu) for b in allocator.bindings()}
    assert bindings == {("127.0.0.1", 1): ("localhost", 3), ("", 1): ("localhost", 2)}
    with pytest.raises(NotFound):
        AllocatorOps(allocator).bind({"job": "a", "host": "127.0.0.1", "local_rank": 2})

    allocator.request(demand("b", 1, 1))  # a: 4 -> 3 gives back GPU 3
    assert allocator.grant("a").placement.gpus_on("localhost") == (0, 1, 2)  # type: ignore[union-attr]
    assert {(b.name, b.local_rank) for b in allocator.bindings()} == {("", 1)}


# ---- workers Horovod dropped on its own ----


@pytest.mark.parametrize(
    ("count", "dead", "bound", "expected"),
    [
        # The dead worker's slot first, wherever it is.
        (1, {0}, {0, 1, 2, 3}, (0,)),
        # Then one no worker ever bound to.
        (2, {1}, {0, 1, 3}, (1, 2)),
        # Then the slots under the dead worker's name (Horovod stopped the name's workers).
        (2, {0}, {0, 1, 2, 3}, (0, 2)),
        # Then the last ones.
        (2, {1}, {0, 1, 2, 3}, (1, 3)),
        (1, set(), {0, 1, 2, 3}, (3,)),
        (3, set(), {0, 1, 2, 3}, (3, 2, 1)),
        (0, {0}, {0, 1, 2, 3}, ()),
        (9, {3}, set(), (3, 2, 1, 0)),
    ],
)
def test_slots_to_give_up_prefer_what_is_gone(
    count: int, dead: set[int], bound: set[int], expected: tuple[int, ...]
) -> None:
    slots = tuple(("h", gpu) for gpu in range(4))
    names = {("h", gpu): ("h", "h2")[gpu % 2] for gpu in range(4)}
    given_up = slots_to_give_up(
        slots,
        count,
        dead=frozenset(("h", g) for g in dead),
        bound=frozenset(("h", g) for g in bound),
        names=names,
    )
    assert given_up == tuple(("h", g) for g in expected)


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_job_that_lost_a_worker_shrinks_to_what_runs_and_grows_back(
    layout: StateLayout,
) -> None:
    clock = Clock()
    events = Events()
    allocator = named_allocator(layout, on_event=events, clock=clock, min_resize_interval=30.0)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    clock.now += 60
    alive = os.getpid()
    for name, rank in [("localhost", 0), ("127.0.0.1", 0), ("localhost", 1), ("127.0.0.1", 1)]:
        AllocatorOps(allocator).bind({"job": "a", "host": name, "local_rank": rank, "pid": alive})
    # The worker of GPU 1 (127.0.0.1, local rank 0) was killed; it bound again under a
    # pid that is gone now.
    AllocatorOps(allocator).bind(
        {"job": "a", "host": "127.0.0.1", "local_rank": 0, "pid": dead_pid()}
    )
    allocator.observe_world_size("a", 4)
    assert events.raised == []
    allocator.observe_world_size("a", 3)  # Horovod went on without it

    grant = allocator.grant("a")
    assert grant is not None and grant.placement.gpus_on("localhost") == (0, 2, 3)
    assert grant.reason.startswith("workers lost: ")
    assert events.raised == [
        (
            "a",
            "Warning",
            "WorkerLost",
            "world size 3 of 4 granted; GPU(s) localhost:1 taken back",
        )
    ]
    assert layout.grant_file("a").read_text() == "localhost:2\n127.0.0.1:1\n"
    # The freed GPU is free at once (its worker is gone) ...
    assert allocator.request(Demand("b", 1, 1, 1, arrival=2)).placement.slots() == (
        ("localhost", 1),
    )
    allocator.release("b")
    # ... and the job grows back once its resize freeze is over.
    assert allocator.request(Demand("a", 1, 4, 4, arrival=1)).placement.size == 3
    clock.now += 30
    assert allocator.request(Demand("a", 1, 4, 4, arrival=1)).placement.size == 4


def test_a_live_worker_on_a_taken_back_gpu_keeps_it_until_it_exits(layout: StateLayout) -> None:
    clock = Clock()
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=30.0,
        clock=clock,
        belongs=any_pid,
    )
    allocator.request(Demand("a", 1, 2, 2, arrival=1))
    worker = subprocess.Popen(["sleep", "60"])
    try:
        for rank in (0, 1):
            AllocatorOps(allocator).bind(
                {"job": "a", "host": "localhost", "local_rank": rank, "pid": worker.pid}
            )
        allocator.observe_world_size("a", 2)
        allocator.observe_world_size("a", 1)  # which worker left cannot be seen: both run
        assert allocator.grant("a").placement.size == 1  # type: ignore[union-attr]
        assert allocator.draining() == {("localhost", 1): "a"}
        allocator.observe_world_size("a", 1)  # a report does not free it: only the exit
        assert not allocator.request(Demand("b", 1, 1, 1, arrival=2)).admitted
    finally:
        worker.kill()
        worker.wait()
    clock.now += 1.0
    assert allocator.request(Demand("b", 1, 1, 1, arrival=2)).placement.slots() == (
        ("localhost", 1),
    )


def test_fewer_workers_than_granted_count_as_lost_only_after_the_grace(
    layout: StateLayout,
) -> None:
    """A grow takes Horovod a while; a worker that never comes must not hold its GPU."""
    clock = Clock()
    events = Events()
    allocator = named_allocator(layout, on_event=events, clock=clock, lost_grace_seconds=60.0)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    allocator.observe_world_size("a", 2)
    clock.now += 59
    allocator.observe_world_size("a", 3)
    assert allocator.grant("a").placement.size == 4  # type: ignore[union-attr]
    assert events.raised == []
    clock.now += 1
    allocator.observe_world_size("a", 3)
    assert allocator.grant("a").placement.size == 3  # type: ignore[union-attr]
    assert [reason for _, _, reason, _ in events.raised] == ["WorkerLost"]


def test_a_grow_whose_workers_keep_binding_is_not_lost_after_the_grace(
    layout: StateLayout,
) -> None:
    """A torchrun grow restarts every worker: the old ones report the old size until they
    stop, which under load took over 60 s (the bench saw the grow undone in 4 of 4 rounds).
    Each new worker binds; the grace counts from the last bind, not from the first short
    report."""
    clock = Clock()
    events = Events()
    allocator = named_allocator(layout, on_event=events, clock=clock, lost_grace_seconds=60.0)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    allocator.observe_world_size("a", 2)
    for name, rank in [(name, rank) for name in NAMES["localhost"] for rank in (0, 1)]:
        clock.now += 50
        AllocatorOps(allocator).bind(
            {"job": "a", "host": name, "local_rank": rank, "pid": os.getpid()}
        )
        allocator.observe_world_size("a", 2)
    assert allocator.grant("a").placement.size == 4  # type: ignore[union-attr]
    assert events.raised == []
    clock.now += 60  # nothing bound for the grace: the missing workers are lost
    allocator.observe_world_size("a", 2)
    assert allocator.grant("a").placement.size == 2  # type: ignore[union-attr]
    assert [reason for _, _, reason, _ in events.raised] == ["WorkerLost"]


def torchrun_allocator(
    layout: StateLayout, clock: Clock, events: Events, agents: set[str]
) -> Allocator:
    """An allocator over a pool of 4 GPUs that presents each GPU as the torchrun engine does
    (`localhost:gpu2`), whose `agents` are the names in `agents` at each question."""
    return Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout, NAMES),
        virtual=True,
        present=lambda job, placement: torchrun.present(placement),
        drain_seconds=0,
        clock=clock,
        on_event=events,
        lost_grace_seconds=60.0,
        belongs=any_pid,
        agents=lambda job: frozenset(agents),
    )


def test_a_torchrun_grow_is_not_lost_while_every_granted_gpus_agent_runs(
    layout: StateLayout,
) -> None:
    """CI at 847fce0 (load 20-47): a torchrun grow 1 -> 3 whose new agents took longer than
    the 60 s grace to import torch and meet was taken back as workers lost, four times
    over; and a round formed without a slow agent (world 2, then 1) reads as a drop. While
    each granted GPU's agent runs, its worker is coming: nothing is lost."""
    clock, events, agents = Clock(), Events(), {"localhost:gpu0"}
    allocator = torchrun_allocator(layout, clock, events, agents)
    allocator.request(Demand("a", 1, 3, 3, arrival=1))
    agents |= {"localhost:gpu1", "localhost:gpu2"}  # the driver started their agents
    allocator.observe_world_size("a", 1)  # the old worker, while the new agents start
    for world in (1, 2, 1, 2):  # still the old one, then rounds forming and re-forming
        clock.now += 100
        allocator.observe_world_size("a", world)
    assert allocator.grant("a").placement.size == 3  # type: ignore[union-attr]
    assert events.raised == []
    # gpu2's agent gave up (its join timeout, its restarts spent): its GPU has nobody coming.
    agents.discard("localhost:gpu2")
    allocator.observe_world_size("a", 2)
    assert allocator.grant("a").placement.size == 3  # type: ignore[union-attr]
    clock.now += 60  # the grace, from the last time it was seen forming
    allocator.observe_world_size("a", 2)
    assert allocator.grant("a").placement.slots() == (("localhost", 0), ("localhost", 1))  # type: ignore[union-attr]
    assert [reason for _, _, reason, _ in events.raised] == ["WorkerLost"]


def test_a_torchrun_drop_with_an_agent_gone_is_a_loss_at_once(layout: StateLayout) -> None:
    clock, events = Clock(), Events()
    agents = {"localhost:gpu0", "localhost:gpu1", "localhost:gpu2"}
    allocator = torchrun_allocator(layout, clock, events, agents)
    allocator.request(Demand("a", 1, 3, 3, arrival=1))
    allocator.observe_world_size("a", 3)
    agents.discard("localhost:gpu1")  # its agent killed: the others form a round of 2
    allocator.observe_world_size("a", 2)
    assert allocator.grant("a").placement.size == 2  # type: ignore[union-attr]
    assert [reason for _, _, reason, _ in events.raised] == ["WorkerLost"]


def test_agent_names_are_the_slots_whose_agent_runs_not_their_workers(tmp_path: Path) -> None:
    """What the operator reads as a job's agents: its processes here that carry a GPU's
    name (`HERD_WORKER_HOST`, which the torchrun driver gives each agent) and no `HERD_GPU`
    (which a worker has from its bind on)."""
    state = tmp_path / "state"
    base = {**os.environ, STATE_DIR_ENV: str(state.resolve()), LAUNCH_ID_ENV: "l1"}
    envs = [
        {JOB_ENV: "tr", WORKER_HOST_ENV: "localhost:gpu1"},  # an agent
        {JOB_ENV: "tr", WORKER_HOST_ENV: "localhost:gpu2", GPU_ENV: "2"},  # a worker
        {JOB_ENV: "other", WORKER_HOST_ENV: "localhost:gpu3"},  # another job's agent
        {JOB_ENV: "tr"},  # the driver
    ]
    procs = [subprocess.Popen(["sleep", "30"], env={**base, **env}) for env in envs]
    try:
        assert agent_names(state, "tr") == {"localhost:gpu1"}
        assert agent_names(tmp_path / "elsewhere", "tr") == frozenset()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert agent_names(state, "tr") == frozenset()


def test_the_end_of_a_shrink_the_operator_asked_for_is_no_loss(layout: StateLayout) -> None:
    events = Events()
    allocator = named_allocator(layout, on_event=events)
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    allocator.observe_world_size("a", 4)
    allocator.request(Demand("b", 2, 2, 2, arrival=2))  # a: 4 -> 2
    allocator.release("b")
    allocator.request(Demand("a", 1, 4, 4, arrival=1))  # and back to 4 before it reported
    assert allocator.grant("a").placement.size == 4  # type: ignore[union-attr]
    allocator.observe_world_size("a", 2)  # the shrink done, the grow not yet
    assert allocator.grant("a").placement.size == 4  # type: ignore[union-attr]
    assert events.raised == []


def test_the_grace_starts_again_when_the_grant_changes(layout: StateLayout) -> None:
    clock = Clock()
    events = Events()
    allocator = named_allocator(layout, on_event=events, clock=clock, lost_grace_seconds=60.0)
    allocator.request(Demand("a", 1, 3, 3, arrival=1))
    allocator.observe_world_size("a", 2)  # one worker still starting
    clock.now += 50
    allocator.request(Demand("a", 1, 4, 4, arrival=1))  # grown to 4
    clock.now += 11
    allocator.observe_world_size("a", 3)
    assert allocator.grant("a").placement.size == 4  # type: ignore[union-attr]
    assert events.raised == []


def test_a_host_horovod_blacklisted_is_taken_back_whole_once_its_workers_exit(
    layout: StateLayout,
) -> None:
    """Two pool hosts on one machine (`--hosts localhost:2,127.0.0.1:2`): a killed worker
    makes Horovod drop its host's other worker too, and go on with the other host."""
    clock = Clock()
    events = Events()
    allocator = Allocator(
        Pool((("localhost", (0, 1)), ("127.0.0.1", (2, 3)))),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=30.0,
        on_event=events,
        clock=clock,
        belongs=any_pid,
    )
    allocator.request(Demand("a", 1, 4, 4, arrival=1))
    stopping = subprocess.Popen(["sleep", "60"])  # the other worker of 127.0.0.1, exiting
    try:
        pids = {("localhost", 0): os.getpid(), ("localhost", 1): os.getpid()}
        pids |= {("127.0.0.1", 0): dead_pid(), ("127.0.0.1", 1): stopping.pid}
        for (host, rank), pid in pids.items():
            AllocatorOps(allocator).bind({"job": "a", "host": host, "local_rank": rank, "pid": pid})
        allocator.observe_world_size("a", 4)
        allocator.observe_world_size("a", 2)
        grant = allocator.grant("a")
        assert grant is not None and grant.placement.slots() == (("localhost", 0), ("localhost", 1))
        assert [reason for _, _, reason, _ in events.raised] == ["WorkerLost"]
        assert allocator.draining() == {("127.0.0.1", 3): "a"}  # its worker still runs
        assert allocator.request(Demand("b", 2, 2, 2, arrival=2)).placement.size == 0
    finally:
        stopping.kill()
        stopping.wait()
    clock.now += 1.0
    grant = allocator.request(Demand("b", 2, 2, 2, arrival=2))
    assert grant.placement.slots() == (("127.0.0.1", 2), ("127.0.0.1", 3))


def test_smallest_first_lets_a_job_overtake_until_the_blocked_one_waited_max_wait(
    layout: StateLayout,
) -> None:
    clock = Clock()
    made = Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=0,
        clock=clock,
        smallest_first=True,
        max_wait_seconds=600.0,
        belongs=any_pid,
    )
    assert made.request(Demand("r", 3, 3, 3, arrival=0.0)).placement.size == 3
    assert made.request(Demand("big", 2, 2, 2, arrival=1.0)).placement.size == 0
    clock.now += 599.0
    # 1 GPU free, big needs 2: the smaller job goes ahead of it.
    assert made.request(Demand("small", 1, 1, 1, arrival=2.0)).placement.size == 1
    made.release("small")
    clock.now += 1.0
    # big has waited 600 s since the decision that left it pending: nobody overtakes it.
    late = made.request(Demand("late", 1, 1, 1, arrival=3.0))
    assert late.placement.size == 0
    assert late.reason == "pending: waiting behind big (priority 0)"
    made.release("r")
    assert made.grant("big").placement.size == 2
    assert made.grant("late").placement.size == 1


def test_max_wait_must_be_positive(layout: StateLayout) -> None:
    pool = Pool.from_counts({"localhost": 1})
    with pytest.raises(ValueError, match=r"max_wait_seconds must be finite and > 0, got 0"):
        Allocator(pool, GrantPublisher(layout), virtual=True, max_wait_seconds=0)


# ---- the workers of a launch, as their bindings show them ----


def test_workers_counts_the_running_workers_bound_since_the_launch(
    allocator: Allocator, tmp_path: Path
) -> None:
    """A job whose script never reports shows its workers through their binds (each with
    its pid): one counts when it runs and started since the launch, so a dead worker, or
    an old process that got a dead worker's pid, does not."""
    assert allocator.workers("a", since=0.0) is None  # holds nothing
    allocator.request(Demand("a", 4, 4, 4))
    since = time.time() - 1.0
    live = subprocess.Popen(["sleep", "600"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for rank, pid in enumerate([live.pid, dead.pid, 1]):  # pid 1 started long before
            AllocatorOps(allocator).bind(
                {"job": "a", "host": "localhost", "local_rank": rank, "pid": pid}
            )
        workers = allocator.workers("a", since)
        assert workers == Workers(
            alive=1, idle=(("localhost", 1), ("localhost", 2), ("localhost", 3))
        )
        assert psutil.Process(1).create_time() < since - 2.0
    finally:
        live.kill()
        live.wait()
    assert allocator.workers("a", since) == Workers(0, tuple(("localhost", i) for i in range(4)))


def test_workers_on_another_host_cannot_be_seen_from_here(layout: StateLayout) -> None:
    made = Allocator(
        Pool.from_counts({"localhost": 1, "node2": 1}),
        GrantPublisher(layout),
        virtual=True,
        belongs=any_pid,
    )
    made.request(Demand("wide", 2, 2, 2))
    assert made.workers("wide", since=0.0) is None


# ---- what a job's worker says is untrusted (issue 27.1) ----


def job_process(job: str) -> subprocess.Popen[bytes]:
    """A process of `job` as the operator starts them: `HERD_JOB` in its environment."""
    process = subprocess.Popen(["sleep", "60"], env={**os.environ, "HERD_JOB": job})
    deadline = time.monotonic() + GUARD_S
    # Popen returns as exec begins, a moment before /proc shows the new environment.
    while not is_process_of_job(job, process.pid):
        assert time.monotonic() < deadline, "its environment never showed"
        time.sleep(0.01)
    return process


@pytest.mark.parametrize("pid", [-1, 0, True, "4242", 4.0, 2**40, [1]])
def test_a_pid_that_is_no_pid_is_refused_naming_the_field(layout: StateLayout, pid: object) -> None:
    """A job's worker bound with pid -1 (its own key, any value it liked); psutil raised
    ValueError for it at each GPU sample and at the next shrink, and every job's reconcile
    failed until the job was deleted."""
    allocator = Allocator(Pool.from_counts({"localhost": 2}), GrantPublisher(layout), virtual=True)
    allocator.request(demand("a", 1, 2))
    with pytest.raises(BadRequest, match=r"^'pid' must be an integer from 1 to 4194304"):
        AllocatorOps(allocator).bind({"job": "a", "host": "localhost", "local_rank": 0, "pid": pid})
    assert allocator.bindings() == []


def test_a_local_pid_must_be_a_process_of_the_job(layout: StateLayout) -> None:
    allocator = Allocator(
        Pool.from_counts({"localhost": 2, "node2": 2}), GrantPublisher(layout), virtual=True
    )
    allocator.request(demand("a", 4, 4))
    ours, other = job_process("a"), job_process("b")
    ops = AllocatorOps(allocator)
    try:
        for pid in (other.pid, os.getpid()):
            with pytest.raises(BadRequest, match=rf"pid {pid} is not a process of job 'a'"):
                ops.bind({"job": "a", "host": "localhost", "local_rank": 0, "pid": pid})
        ops.bind({"job": "a", "host": "localhost", "local_rank": 0, "pid": ours.pid})
        # Another host's processes cannot be seen from here: its pid is taken as said.
        ops.bind({"job": "a", "host": "node2", "local_rank": 1, "pid": other.pid})
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()
    assert sorted((b.host, b.pid) for b in allocator.bindings()) == sorted(
        [("localhost", ours.pid), ("node2", other.pid)]
    )


@pytest.mark.parametrize("pid", [-1, 0, 2**40])
def test_a_pid_that_is_no_process_is_simply_not_alive(pid: int) -> None:
    """Whatever a binding holds, the checks that read the process table answer; they raised
    ValueError for -1 (psutil's), which reached every job's reconcile."""
    assert alive(pid) is False
    assert started_since(pid, 0.0) is False
    assert is_process_of_job("a", pid) is False
    assert process_tree_rss(pid) is None
