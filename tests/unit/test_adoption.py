"""Crash-only start-up: jobs outlive the operator, and a restarted one adopts them.

Real processes: the keeper records how a command ended; a second `Launcher` on the same
records directory (what a restarted operator makes) takes over a launch the first one
started, or learns how it ended while no operator ran. The allocator holds the GPUs of
adopted jobs until their first request.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from herd_operator.controllers.loop import ControlLoop
from herd_operator.controllers.ports import LaunchInfo, ProcessPhase, ProcessState
from herd_operator.controllers.reconciler import JobReconciler
from herd_operator.controllers.workqueue import WorkQueue
from herd_operator.environment import JOB_ENV, STATE_DIR_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.adoption import _bindings, _placement_of, adopt, adopted_holdings
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import Binding
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.dispatch import EngineDispatch
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.keeper import read_exit_file, read_launch_error
from herd_operator.runtime.launcher import Adopted, Launcher, LaunchRequest
from herd_operator.runtime.operator import ExitsRecordedFirst
from herd_operator.runtime.operator import Operator as HerdOperator
from herd_operator.runtime.pools import StaticPool
from herd_operator.runtime.process_table import JobProcess, find_orphans, job_processes
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs import ConditionType, HerdJob, HerdJobSpec, is_true
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Demand, Drain, Placement, Pool, ResizeMode
from tests.unit.sinks import RecordingSink
from tests.unit.test_launcher import Exits
from tests.unit.test_reconciler import FakeSpecs, herd_job

GUARD_S = 30.0
"""Hang guard for waiting on processes; never a performance expectation."""


def spec() -> HerdJobSpec:
    return HerdJobSpec.model_validate(
        {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}, "env": {"A": "1"}}
    )


def request(tmp_path: Path, script: str, job: str = "train") -> LaunchRequest:
    return LaunchRequest(
        job=job,
        generation=3,
        argv=[sys.executable, "-c", script],
        log_file=tmp_path / "logs" / f"{job}.log",
        command="fake-run",
        spec=spec(),
        working_dir=str(tmp_path),
    )


def wait_until(probe: object, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not probe():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def records(tmp_path: Path) -> Path:
    return tmp_path / "launches"


@pytest.fixture
def launchers(records: Path) -> Iterator[list[Launcher]]:
    made: list[Launcher] = []
    yield made
    for launcher in made:
        launcher.stop_all(timeout=10)


def launcher_on(records: Path, made: list[Launcher], exits: Exits | None = None) -> Launcher:
    launcher = Launcher(exits or Exits(), grace_seconds=2.0, records_dir=records)
    made.append(launcher)
    return launcher


# ---- the keeper ----


def keep(tmp_path: Path, *command: str) -> tuple[int, int | None]:
    exit_file = tmp_path / "exit"
    done = subprocess.run(
        [sys.executable, "-m", "herd_operator.runtime.keeper", str(exit_file), "--", *command],
        timeout=GUARD_S,
    )
    return done.returncode, read_exit_file(exit_file)


@pytest.mark.parametrize("code", [0, 3])
def test_keeper_records_the_exit_status_and_ends_with_it(tmp_path: Path, code: int) -> None:
    assert keep(tmp_path, sys.executable, "-c", f"raise SystemExit({code})") == (code, code)
    assert stat.S_IMODE((tmp_path / "exit").stat().st_mode) == 0o600


def test_keeper_records_a_death_by_signal_and_dies_of_the_same(tmp_path: Path) -> None:
    command = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert keep(tmp_path, sys.executable, "-c", command) == (-signal.SIGKILL, -signal.SIGKILL)


def test_keeper_stays_for_a_sigterm_to_its_group_and_records_how_the_command_ended(
    tmp_path: Path,
) -> None:
    """A stop signals the whole group: the command exits its own way, the keeper records it."""
    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    keeper = subprocess.Popen(
        [sys.executable, "-m", "herd_operator.runtime.keeper", str(tmp_path / "exit"), "--",
         sys.executable, "-c", script],
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(ready.exists, "the command to start")
        os.killpg(keeper.pid, signal.SIGTERM)
        assert keeper.wait(GUARD_S) == 7
    finally:
        if keeper.poll() is None:
            os.killpg(keeper.pid, signal.SIGKILL)
    assert read_exit_file(tmp_path / "exit") == 7


def test_keeper_cannot_run_the_command(tmp_path: Path) -> None:
    program = tmp_path / "no-such-program"
    assert keep(tmp_path, str(program)) == (127, 127)
    assert read_launch_error(tmp_path / "exit") == (
        f"cannot run {str(program)!r}: No such file or directory"
    )


def test_keeper_tells_a_command_that_ran_and_exited_127_from_one_that_never_ran(
    tmp_path: Path,
) -> None:
    assert keep(tmp_path, sys.executable, "-c", "raise SystemExit(127)") == (127, 127)
    assert read_launch_error(tmp_path / "exit") is None


def test_the_launcher_reports_a_command_its_keeper_could_not_run(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    exits = Exits()
    launcher = launcher_on(records, launchers, exits)
    launched = replace(request(tmp_path, ""), argv=[str(tmp_path / "no-horovodrun")])
    launcher.launch(launched)
    assert exits.called.wait(GUARD_S), "the keeper's end was not noticed"
    state = launcher.state("train")
    assert (state.phase, state.exit_code) == (ProcessPhase.EXITED, 127)
    assert state.launch_error is not None and "no-horovodrun" in state.launch_error
    assert "No such file or directory" in state.launch_error


def test_the_launcher_reports_a_keeper_that_could_not_start(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    exits = Exits()
    launcher = launcher_on(records, launchers, exits)
    # The keeper's Python cannot start: it finds no standard library there.
    launched = replace(request(tmp_path, "pass"), env={"PYTHONHOME": str(tmp_path / "none")})
    launcher.launch(launched)
    assert exits.called.wait(GUARD_S), "the keeper's end was not noticed"
    state = launcher.state("train")
    assert state.phase == ProcessPhase.EXITED and state.exit_code
    assert state.launch_error is not None
    assert state.launch_error.startswith(
        f"the keeper ({sys.executable} -m herd_operator.runtime.keeper) exited with status "
    )
    assert "Python" in (tmp_path / "logs" / "train.log").read_text()


def test_a_command_that_fails_is_not_a_launch_error(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    exits = Exits()
    launcher = launcher_on(records, launchers, exits)
    launcher.launch(request(tmp_path, "raise SystemExit(3)"))
    assert exits.called.wait(GUARD_S), "the keeper's end was not noticed"
    state = launcher.state("train")
    assert (state.exit_code, state.launch_error) == (3, None)


# ---- a restarted operator's launcher ----

SLEEPER = "import time; time.sleep(120)"


def sleeper(ready: Path) -> str:
    """Sleeps once started; `ready` says so (then the keeper has its handlers too)."""
    return f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"


def test_a_running_launch_is_adopted_and_supervised_by_the_next_launcher(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    first = launcher_on(records, launchers)
    info = first.launch(request(tmp_path, sleeper(tmp_path / "ready")))
    wait_until((tmp_path / "ready").exists, "the command to start")
    record = records / "train.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600, "the record holds the spec's env"
    assert "SLEEPER" not in record.read_text()

    exits = Exits()
    second = launcher_on(records, launchers, exits)  # the first one "crashed": never stopped
    (adopted,) = second.adopt_recorded()
    assert (adopted.job, adopted.running) == ("train", True)
    assert adopted.info.launch_id == info.launch_id and adopted.info.pid == info.pid
    assert adopted.info.generation == 3 and adopted.info.spec == spec()
    state = second.state("train")
    assert state.phase == ProcessPhase.RUNNING and state.launch == adopted.info

    second.stop("train")
    assert exits.called.wait(GUARD_S), "the adopted launch's end was not noticed"
    state = second.state("train")
    assert state.phase == ProcessPhase.EXITED and state.stopped_by_us
    assert state.exit_code == -signal.SIGTERM
    second.forget("train")
    assert second.state("train").phase == ProcessPhase.ABSENT
    assert len(list(records.iterdir())) == 2, "kept until the exit is recorded durably"
    second.release_forgotten()
    assert list(records.iterdir()) == [], "the record and the exit file are removed"


def test_a_launch_that_ended_while_no_operator_ran_is_reported_with_its_status(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    first = launcher_on(records, launchers)
    info = first.launch(request(tmp_path, "raise SystemExit(4)"))
    wait_until(lambda: not psutil.pid_exists(info.pid) or _zombie(info.pid), "the exit")

    noticed = time.time()  # after the exit, before the next launcher sees it

    second = launcher_on(records, launchers)
    (adopted,) = second.adopt_recorded()
    assert not adopted.running
    state = second.state("train")
    assert (state.phase, state.exit_code, state.stopped_by_us) == (ProcessPhase.EXITED, 4, False)
    # When it ended (the keeper's record), not when this launcher found out: the job's
    # finishedAt.
    exit_file = records / f"train.{info.launch_id}.exit"
    assert state.ended_at == json.loads(exit_file.read_text())["ended_at"]
    assert state.ended_at is not None and info.started_at <= state.ended_at <= noticed


def test_a_launch_whose_keeper_was_killed_too_has_an_unknown_status(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    first = launcher_on(records, launchers)
    info = first.launch(request(tmp_path, SLEEPER))
    os.killpg(info.pid, signal.SIGKILL)
    wait_until(lambda: _zombie(info.pid) or not psutil.pid_exists(info.pid), "the kill")

    (adopted,) = launcher_on(records, launchers).adopt_recorded()
    assert not adopted.running
    assert launchers[-1].state("train").exit_code is None


def test_a_pid_reused_by_another_process_is_not_adopted(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    """The record's pid now belongs to a process of another launch (or none): not ours."""
    first = launcher_on(records, launchers)
    info = first.launch(request(tmp_path, SLEEPER))
    record = json.loads((records / "train.json").read_text())
    record["launch_id"] = "0" * 32  # as if the pid had been reused by a stranger
    (records / "train.json").write_text(json.dumps(record))
    (adopted,) = launcher_on(records, launchers).adopt_recorded()
    assert not adopted.running
    assert psutil.pid_exists(info.pid), "the pid lives on, under another launch id"
    # Nor is the stranger a leftover of the ended launch, to be stopped with it (it was,
    # by its pid alone, until the pid was no longer trusted once the keeper was gone).
    state = launchers[-1].state("train")
    assert (state.phase, state.exit_code) == (ProcessPhase.EXITED, None)
    assert first.state("train").phase == ProcessPhase.RUNNING


def test_an_unreadable_record_is_dropped(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    """Its processes are then nobody's: the operator stops them as orphans (find_orphans)."""
    first = launcher_on(records, launchers)
    info = first.launch(request(tmp_path, SLEEPER))
    (records / "train.json").write_text("{not json")
    second = launcher_on(records, launchers)
    assert second.adopt_recorded() == []
    assert not (records / "train.json").exists()
    assert second.state("train").phase == ProcessPhase.ABSENT
    orphan = JobProcess(info.pid, "train", info.launch_id, {})
    assert [o.launch_id for o in find_orphans([orphan], adopted=set())] == [info.launch_id]
    assert find_orphans([orphan], adopted={info.launch_id}) == []


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


# ---- the allocator takes back what adopted jobs hold ----


def allocator(gpus: int = 4) -> tuple[Allocator, RecordingSink, list[dict[str, Placement]]]:
    sink, decisions = RecordingSink(), []
    made = Allocator(
        Pool.from_counts({"localhost": gpus}),
        sink,
        virtual=True,
        on_decision=lambda decision: decisions.append(dict(decision.placements)),
    )
    return made, sink, decisions


def place(*gpus: int, host: str = "localhost") -> Placement:
    return Placement(((host, gpus),))


def test_restored_gpus_are_held_for_their_job_until_it_asks_again() -> None:
    alloc, sink, decisions = allocator(4)
    alloc.restore({"a": place(3, 1)}, [])
    assert sink.published == {"a": place(3, 1)}, "the grant is where its discovery reads it"
    assert decisions[-1] == {"a": place(3, 1)}, "recorded at once"

    b = alloc.request(Demand("b", 1, 4, 4, arrival=2))
    assert b is not None and set(b.placement.slots()).isdisjoint(place(3, 1).slots())
    assert alloc.grant("a") is not None and alloc.grant("a").placement == place(3, 1)  # type: ignore[union-attr]

    a = alloc.request(Demand("a", 1, 2, 2, arrival=1))
    assert a is not None and a.placement == place(3, 1), "a running job keeps its GPUs and order"


def test_a_restored_job_released_before_it_asks_frees_its_gpus() -> None:
    alloc, sink, _ = allocator(2)
    alloc.restore({"a": place(0, 1)}, [])
    pending = alloc.request(Demand("b", 2, 2, 2, arrival=2))
    assert pending is not None and not pending.admitted
    alloc.release("a")
    assert "a" not in sink.published
    assert alloc.grant("b") is not None and alloc.grant("b").placement.size == 2  # type: ignore[union-attr]


def test_restore_drops_gpus_outside_the_pool_and_gpus_claimed_twice() -> None:
    alloc, _, _ = allocator(2)
    alloc.restore({"a": place(0, 5), "b": place(0, 1)}, [])
    assert alloc.placements() == {"a": place(0), "b": place(1)}


def test_restore_keeps_the_bindings_of_live_workers_on_held_gpus() -> None:
    alloc, _, _ = allocator(4)
    workers = [
        Binding("a", "localhost", 0, 2, 111),
        Binding("a", "localhost", 1, 3, 112),
        Binding("a", "localhost", 2, 0, 113),  # GPU 0 is not a's: not restored
        Binding("z", "localhost", 0, 1, 114),  # no such adopted job
    ]
    alloc.restore({"a": place(2, 3)}, workers)
    assert sorted(b.pid for b in alloc.bindings() if b.pid) == [111, 112]


def test_bindings_and_placement_from_the_workers_environment() -> None:
    """What the shim exported tells which GPU each live worker has, when the store does not."""
    adopted = {"L1": Adopted("a", object(), True)}  # type: ignore[arg-type]
    processes = [
        JobProcess(10, "a", "L1", {}),  # horovodrun itself: no GPU
        JobProcess(11, "a", "L1", {"HERD_GPU": "3", "HOROVOD_LOCAL_RANK": "1",
                                   "HOROVOD_HOSTNAME": "localhost"}),
        JobProcess(12, "a", "L1", {"HERD_GPU": "2", "HOROVOD_LOCAL_RANK": "0",
                                   "HOROVOD_HOSTNAME": "localhost"}),
        JobProcess(13, "b", "L2", {"HERD_GPU": "0", "HOROVOD_LOCAL_RANK": "0"}),  # not adopted
        JobProcess(14, "a", "L1", {"HERD_GPU": "x"}),
    ]  # fmt: skip
    found = _bindings(processes, adopted)
    assert sorted((b.pid, b.gpu, b.local_rank, b.name) for b in found) == [
        (11, 3, 1, "localhost"),
        (12, 2, 0, "localhost"),
    ]
    pool = Pool.from_counts({"localhost": 4})
    assert _placement_of(found, "a", pool) == place(2, 3)
    aliased = [Binding("a", "127.0.0.1", 0, 1, 15, "127.0.0.1"), *found]
    assert _placement_of(aliased, "a", pool) == place(1, 2, 3), "another name of the lone host"


def test_torchrun_workers_on_a_pool_of_several_hosts_give_their_placement_and_drains() -> None:
    """A torchrun worker binds under its GPU's own name (`h2:gpu1`): on a pool of several
    hosts it stands for its host, for the placement a lost decision leaves and for a GPU a
    live worker holds outside the job's placement; a name of no pool host stays unknown."""
    pool = Pool.from_counts({"h1": 2, "h2": 2})
    bound = [
        Binding("tr", "h1:gpu0", 0, 0, 31, "h1:gpu0"),
        Binding("tr", "h2:gpu1", 0, 1, 32, "h2:gpu1"),
        Binding("tr", "h9:gpu0", 0, 0, 33, "h9:gpu0"),  # no such host
    ]
    assert _placement_of(bound, "tr", pool) == Placement((("h1", (0,)), ("h2", (1,))))
    placements, draining = adopted_holdings(
        running={"tr"},
        stored={"tr": Placement((("h1", (0,)),))},
        stored_draining={},
        bound=bound,
        pool=pool,
        now=100.0,
    )
    assert placements == {"tr": Placement((("h1", (0,)),))}
    assert draining == {("h2", 1): Drain("tr", 100.0, (("h2", 32),))}


def test_restored_bindings_under_another_name_of_the_host_find_their_pool_host() -> None:
    """A lone local host is shown to Horovod under several names; a worker bound under one of
    them is matched to the pool host through the job's presentation."""

    def two_names(job: str, placement: Placement) -> dict[str, tuple[tuple[str, int], ...]]:
        slots = placement.slots()
        return {"localhost": slots[0::2], "127.0.0.1": slots[1::2]}

    alloc = Allocator(
        Pool.from_counts({"localhost": 4}), RecordingSink(), virtual=True, present=two_names
    )
    alloc.restore(
        {"a": place(0, 1, 2)},
        [
            Binding("a", "127.0.0.1", 0, 1, 21, "127.0.0.1"),  # local rank 0 of the 2nd name
            Binding("a", "localhost", 1, 2, 22, "localhost"),
            Binding("a", "127.0.0.1", 1, 3, 23, "127.0.0.1"),  # GPU 3 is not a's
        ],
    )
    restored = sorted((b.pid, b.host, b.name, b.gpu) for b in alloc.bindings())
    assert restored == [(21, "localhost", "127.0.0.1", 1), (22, "localhost", "", 2)]


# ---- the last crash window: a finished job's record outlives its final status's commit ----


class JobsOnLauncher:
    """The reconciler's launcher port over the real `Launcher` (what `JobLauncher` does,
    without an engine): each job runs its spec's command as it is, through the keeper.
    With `state_dir`, its processes carry the markers `job_processes` finds (the operator
    sets them)."""

    def __init__(self, launcher: Launcher, logs: Path, state_dir: Path | None = None) -> None:
        self.launcher = launcher
        self.logs = logs
        self.env = {} if state_dir is None else {STATE_DIR_ENV: str(state_dir.resolve())}
        self.starts: list[str] = []

    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo:
        launched = self.launcher.launch(
            LaunchRequest(
                job=job.name,
                generation=generation,
                argv=list(job.spec.command),
                log_file=self.logs / f"{job.name}.log",
                command="python",
                spec=job.spec,
                env={**self.env, JOB_ENV: job.name},
            )
        )
        self.starts.append(launched.launch_id)
        return launched

    def state(self, name: str) -> ProcessState:
        return self.launcher.state(name)

    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        return ""

    def resize_mode(self, kind: str) -> ResizeMode | None:
        return None  # no engine: a resize's event says no more than its time

    def stop(self, name: str) -> None:
        self.launcher.stop(name)

    def forget(self, name: str) -> None:
        self.launcher.forget(name)


class Successors:
    """At each instant the durable state changes, what an operator started after a SIGKILL
    right then would find: the job's committed status and its launch record."""

    def __init__(self, database: Path, records: Path, job: str) -> None:
        self.database = database
        self.records = records
        self.job = job
        self.seen: list[tuple[str, bool, bool]] = []

    def look(self, instant: str) -> None:
        with Store.open_readonly(self.database) as store:  # committed writes only
            record = store.get_job(self.job)
            status = record.status if record is not None else HerdJobStatus()
        finished = any(
            is_true(status.conditions, kind)
            for kind in (ConditionType.Succeeded, ConditionType.Failed)
        )
        adoptable = (self.records / f"{self.job}.json").exists()
        self.seen.append((instant, finished, adoptable))


class ProbedLauncher(Launcher):
    """A real launcher that lets `Successors` look at each of its steps that change files."""

    successors: Successors

    def forget(self, job: str) -> None:
        super().forget(job)
        self.successors.look("after forget")

    def release_forgotten(self) -> None:
        self.successors.look("before release")
        super().release_forgotten()
        self.successors.look("after release")


def test_no_instant_of_a_jobs_end_lets_a_killed_operator_run_it_again(tmp_path: Path) -> None:
    """The launch record of a finished job goes only after the status saying it finished is
    committed: at every step, a successor either sees the job finished or has the record
    to adopt (and its keeper's exit status). Removing the record at `forget` (the old
    order) leaves "after forget" with neither, and the job ran again."""
    layout = StateLayout(tmp_path / "state")
    layout.create()
    specs = FakeSpecs()
    job = herd_job("done", gpus=(1, 1), command=[sys.executable, "-c", "pass"])
    specs.put(job)
    exits = Exits()
    launcher = ProbedLauncher(exits, grace_seconds=2.0, records_dir=layout.launches_dir)
    launcher.successors = successors = Successors(layout.database, layout.launches_dir, "done")
    allocator = Allocator(Pool.from_counts({"localhost": 1}), RecordingSink(), virtual=True)
    queue = WorkQueue()
    try:
        with Store(layout.database) as store:
            reconciler = JobReconciler(
                specs, store, allocator, JobsOnLauncher(launcher, layout.logs_dir)
            )
            loop = ControlLoop(queue, reconciler, allocator, ExitsRecordedFirst(store, launcher))
            queue.add("done")
            loop.run_once(timeout=0)
            assert launcher.state("done").phase != ProcessPhase.ABSENT, "it was started"
            assert exits.called.wait(GUARD_S), "the job's end was not noticed"
            wait_until(lambda: launcher.state("done").phase == ProcessPhase.EXITED, "the exit")
            queue.add("done")
            loop.run_once(timeout=0)  # records the exit

            record = store.get_job("done")
            assert record is not None and is_true(record.status.conditions, ConditionType.Succeeded)
    finally:
        launcher.stop_all(timeout=GUARD_S)
    assert [instant for instant, _, _ in successors.seen][-3:] == [
        "after forget",
        "before release",
        "after release",
    ]
    for instant, finished, adoptable in successors.seen:
        assert finished or adoptable, f"a kill {instant} would run the finished job again"
    assert list(layout.launches_dir.iterdir()) == [], "the record went once it was not needed"


def test_a_lost_group_gives_the_exits_it_forgot_back_to_the_reconciles_that_redo_it(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    """A full disk rolls back the status that recorded an exit: the exit must be seen again,
    or the redone reconcile finds no process and starts the job again."""
    launcher = launcher_on(records, launchers)
    info = launcher.launch(request(tmp_path, "raise SystemExit(0)"))
    wait_until(lambda: launcher.state("train").phase == ProcessPhase.EXITED, "the exit")

    launcher.forget("train")
    assert launcher.state("train").phase == ProcessPhase.ABSENT
    launcher.restore_forgotten()

    state = launcher.state("train")
    assert (state.phase, state.exit_code, state.launch) == (ProcessPhase.EXITED, 0, info)
    launcher.release_forgotten()  # nothing forgotten is left to release
    assert (records / "train.json").exists()


def test_a_record_of_a_relaunched_job_is_not_released_with_the_old_launch(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    launcher = launcher_on(records, launchers)
    first = launcher.launch(request(tmp_path, "raise SystemExit(1)"))
    wait_until(lambda: launcher.state("train").phase == ProcessPhase.EXITED, "the exit")
    launcher.forget("train")
    second = launcher.launch(request(tmp_path, SLEEPER))  # a restart in the same group

    launcher.release_forgotten()

    assert not (records / f"train.{first.launch_id}.exit").exists()
    (adopted,) = launcher_on(records, launchers).adopt_recorded()
    assert adopted.info.launch_id == second.launch_id and adopted.running


# ---- the first crash window: a launch's start, from its record to the status naming it ----


class Killed(BaseException):
    """The operator's SIGKILL at a chosen instant: nothing after it runs, no handler either
    (the launcher's clean-up on a failed start catches errors, not this)."""


KILL_POINTS = ("before the process", "after the process, before its pid", "before the commit")


class KilledLauncher(Launcher):
    """A real launcher whose operator is killed at `kill_at` during its first launch."""

    kill_at = ""

    def _spawn(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if self.kill_at == "before the process":
            raise Killed
        self.spawned = super()._spawn(*args, **kwargs)
        return self.spawned

    def _record_started(self, job: str, info: LaunchInfo) -> None:
        if self.kill_at == "after the process, before its pid":
            raise Killed
        super()._record_started(job, info)

    def launch(self, request: LaunchRequest) -> LaunchInfo:
        launched = super().launch(request)
        if self.kill_at == "before the commit":
            raise Killed  # the reconcile never saved the status, the group never committed
        return launched


@contextlib.contextmanager
def killed_in_the_group(store: Store) -> Iterator[None]:
    """A store group the operator was killed in: none of its writes is committed."""
    with contextlib.suppress(Killed, StoreError), store.transaction():
        try:
            yield
        finally:
            store._conn.execute("ROLLBACK")  # what SQLite does with a killed writer's group


class Operator:
    """What a (re)started operator has: a store, a launcher, an allocator, a reconciler."""

    def __init__(
        self,
        layout: StateLayout,
        specs: FakeSpecs,
        launcher: Launcher,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = Store(layout.database)
        self.launcher = launcher
        self.port = JobsOnLauncher(launcher, layout.logs_dir, layout.root)
        allocator = Allocator(Pool.from_counts({"localhost": 1}), RecordingSink(), virtual=True)
        self.reconciler = JobReconciler(specs, self.store, allocator, self.port, clock=clock)

    def started_events(self, job: str) -> list[str]:
        return [event.message for event in self.store.events(job) if event.reason == "Started"]


@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_an_operator_killed_at_any_point_of_a_launch_leaves_one_launch_and_one_started_event(
    tmp_path: Path, kill_at: str
) -> None:
    """The launch record is written before the process starts: whichever instant of the
    start the kill hits, the successor finds no orphan to stop, adopts a launch that runs
    (0 relaunches), launches exactly once when none ran, and its status ends naming the
    launch, with one `Started` event. Before the change, a kill after the process started
    and before its record left a launch the successor stopped and ran again."""
    layout = StateLayout(tmp_path / "state")
    layout.create()
    specs = FakeSpecs()
    go, ran = tmp_path / "go", tmp_path / "ran"
    # Says it ran, then lives until the test says so: no timing decides what the successor
    # sees.
    waits = (
        f"import pathlib, time\nwith open({str(ran)!r}, 'a') as f: f.write('ran\\n')\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)"
    )
    specs.put(herd_job("train", gpus=(1, 1), command=[sys.executable, "-c", waits]))
    first_launcher = KilledLauncher(Exits(), grace_seconds=2.0, records_dir=layout.launches_dir)
    first_launcher.kill_at = kill_at
    successor_launcher = Launcher(Exits(), grace_seconds=2.0, records_dir=layout.launches_dir)
    try:
        first = Operator(layout, specs, first_launcher)
        with killed_in_the_group(first.store):
            first.reconciler.reconcile("train")
        first.store.close()
        spawned = getattr(first_launcher, "spawned", None)
        assert (spawned is None) == (kill_at == "before the process")

        successor = Operator(layout, specs, successor_launcher)
        adopted = successor_launcher.adopt_recorded()  # what the operator's `adopt` does first
        running = {item.info.launch_id for item in adopted if item.running}
        assert find_orphans(job_processes(layout.root), running) == [], "nothing to stop"
        if spawned is None:
            assert adopted == [] and not list(layout.launches_dir.glob("*.json"))
        else:
            (item,) = adopted
            assert item.running and item.info.pid == spawned.pid
        successor.reconciler.reconcile("train")
        successor.reconciler.reconcile("train")

        assert len(successor.port.starts) == (1 if spawned is None else 0)
        (launch_id,) = running or set(successor.port.starts)
        record = successor.store.get_job("train")
        assert record is not None and record.status.launch_id == launch_id
        assert len(successor.started_events("train")) == 1
        assert is_true(record.status.conditions, ConditionType.Running)

        go.touch()  # the job ends; its exit is recorded like any other
        wait_until(
            lambda: successor_launcher.state("train").phase == ProcessPhase.EXITED, "the exit"
        )
        successor.reconciler.reconcile("train")
        record = successor.store.get_job("train")
        assert record is not None and is_true(record.status.conditions, ConditionType.Succeeded)
        assert len(successor.started_events("train")) == 1
        assert ran.read_text() == "ran\n", "the command ran once"
        successor.store.close()
    finally:
        go.touch()
        for launcher in (first_launcher, successor_launcher):
            launcher.stop_all(timeout=GUARD_S)
        if spawned := getattr(first_launcher, "spawned", None):
            spawned.wait(GUARD_S)


def test_a_job_that_ended_while_no_operator_ran_finished_when_it_ended(tmp_path: Path) -> None:
    """Its `finishedAt` was the next operator's first reconcile: the keeper's exit record
    knows when it ended, and the successor's status says so."""
    layout = StateLayout(tmp_path / "state")
    layout.create()
    specs = FakeSpecs()
    specs.put(herd_job("train", gpus=(1, 1), command=[sys.executable, "-c", "pass"]))
    first_launcher = Launcher(Exits(), grace_seconds=2.0, records_dir=layout.launches_dir)
    successor_launcher = Launcher(Exits(), grace_seconds=2.0, records_dir=layout.launches_dir)
    try:
        first = Operator(layout, specs, first_launcher)
        first.reconciler.reconcile("train")  # launched
        wait_until(lambda: first_launcher.state("train").phase == ProcessPhase.EXITED, "the end")
        first.store.close()  # gone before it reconciled the end
        (exit_file,) = layout.launches_dir.glob("train.*.exit")
        ended = json.loads(exit_file.read_text())["ended_at"]

        # The next operator starts ten minutes later.
        successor = Operator(layout, specs, successor_launcher, clock=lambda: ended + 600.0)
        (adopted,) = successor_launcher.adopt_recorded()
        assert not adopted.running
        successor.reconciler.reconcile("train")

        record = successor.store.get_job("train")
        assert record is not None and is_true(record.status.conditions, ConditionType.Succeeded)
        assert record.status.finished_at == ended
        successor.store.close()
    finally:
        for launcher in (first_launcher, successor_launcher):
            launcher.stop_all(timeout=GUARD_S)


def test_a_launch_recorded_as_starting_that_ended_before_the_restart_is_not_run_again(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    """Killed after the process started and before its pid was recorded, and the job ended
    while no operator ran: its keeper's exit file says how, and names the keeper."""
    first = KilledLauncher(Exits(), grace_seconds=2.0, records_dir=records)
    first.kill_at = "after the process, before its pid"
    launchers.append(first)
    with pytest.raises(Killed):
        first.launch(request(tmp_path, "raise SystemExit(5)"))
    assert first.spawned.wait(GUARD_S) == 5
    assert json.loads((records / "train.json").read_text())["pid"] is None, "still starting"

    (adopted,) = launcher_on(records, launchers).adopt_recorded()

    assert not adopted.running and adopted.info.pid == first.spawned.pid
    state = launchers[-1].state("train")
    assert (state.phase, state.exit_code) == (ProcessPhase.EXITED, 5)


def test_a_failed_start_leaves_no_record_of_a_launch_that_never_ran(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    launcher = launcher_on(records, launchers)
    with pytest.raises(OSError):
        launcher.launch(replace(request(tmp_path, "pass"), working_dir=str(tmp_path / "none")))
    assert list(records.glob("*.json")) == []
    assert launcher.state("train").phase == ProcessPhase.ABSENT


# ---- what adopted jobs hold: placements, drains, and the GPUs their live workers are on ----


def drain(job: str, at: float = 10.0, *pids: int, after_loss: bool = False) -> Drain:
    return Drain(job, at, tuple(("localhost", pid) for pid in pids), after_loss)


def test_adopted_holdings_keeps_the_stores_placements_and_the_drains_of_running_jobs() -> None:
    pool = Pool.from_counts({"localhost": 6})
    placements, draining = adopted_holdings(
        running={"slow", "steady"},
        stored={"slow": place(0, 1), "steady": place(4), "ended": place(5)},
        stored_draining={
            ("localhost", 2): drain("slow", 10.0, 41),
            ("localhost", 3): drain("slow", 10.0, after_loss=True),
            ("localhost", 5): drain("ended", 10.0, 51),  # its job is gone: so are its workers
        },
        bound=[
            Binding("slow", "localhost", 0, 0, 30, "localhost"),
            Binding("slow", "localhost", 2, 2, 42, "localhost"),  # still on the draining GPU
        ],
        pool=pool,
        now=100.0,
    )
    assert placements == {"slow": place(0, 1), "steady": place(4)}
    assert draining == {
        ("localhost", 2): Drain("slow", 10.0, (("localhost", 41), ("localhost", 42))),
        ("localhost", 3): drain("slow", 10.0, after_loss=True),
    }


def test_a_live_worker_outside_its_jobs_placement_makes_its_gpu_drain() -> None:
    """The decision that shrank the job was not recorded (or its drain record was lost): the
    worker still on the GPU says the GPU is not free. A name of the lone host counts as it."""
    pool = Pool.from_counts({"localhost": 4})
    placements, draining = adopted_holdings(
        running={"slow", "other"},
        stored={"slow": place(0, 1), "other": place(3)},
        stored_draining={},
        bound=[
            Binding("slow", "127.0.0.1", 2, 2, 42, "127.0.0.1"),
            Binding("slow", "localhost", 3, 3, 43, "localhost"),  # on another job's GPU
            Binding("gone", "localhost", 0, 3, 44, "localhost"),  # a job not adopted
        ],
        pool=pool,
        now=100.0,
    )
    assert placements == {"slow": place(0, 1), "other": place(3)}
    assert draining == {("localhost", 2): Drain("slow", 100.0, (("localhost", 42),))}


def test_a_job_with_no_stored_allocation_holds_what_its_workers_show() -> None:
    pool = Pool.from_counts({"h1": 2, "h2": 2})
    placements, draining = adopted_holdings(
        running={"new"},
        stored={},
        stored_draining={},
        bound=[Binding("new", "h2", 0, 1, 7, "h2"), Binding("new", "h3", 0, 0, 8, "h3")],
        pool=pool,
        now=1.0,
    )
    assert placements == {"new": place(1, host="h2")}, "h3 is no host of the pool"
    assert draining == {}


def test_restored_drains_hold_their_gpus_until_their_workers_exit_or_the_job_reports(
    tmp_path: Path,
) -> None:
    clock = [100.0]
    alloc = Allocator(
        Pool.from_counts({"localhost": 4}), RecordingSink(), virtual=True, clock=lambda: clock[0]
    )
    worker = subprocess.Popen(["sleep", "60"])
    try:
        alloc.restore(
            {"slow": place(0, 1)},
            [],
            {
                ("localhost", 2): drain("slow", time.time(), worker.pid),
                ("localhost", 3): drain("slow", time.time()),
            },
        )
        assert alloc.draining() == {("localhost", 2): "slow", ("localhost", 3): "slow"}
        urgent = alloc.request(Demand("urgent", 2, 2, 2, priority=10, arrival=2))
        assert urgent is not None and not urgent.admitted, "both GPUs still drain"
    finally:
        worker.kill()
        worker.wait()
    clock[0] += 1.0  # the next look at the drains' workers: GPU 2's is gone
    urgent = alloc.request(Demand("urgent", 2, 2, 2, priority=10, arrival=2))
    assert urgent is not None and not urgent.admitted, "GPU 3 still drains (no pid to watch)"
    assert alloc.draining() == {("localhost", 3): "slow"}
    alloc.request(Demand("slow", 1, 4, 2, arrival=1))  # slow's first reconcile
    alloc.observe_world_size("slow", 2)  # it runs at 2: the GPU given back is left
    urgent_grant = alloc.grant("urgent")
    assert urgent_grant is not None and sorted(urgent_grant.placement.slots()) == [
        ("localhost", 2),
        ("localhost", 3),
    ]


def test_a_restored_drain_keeps_the_deadline_it_had() -> None:
    warned: list[str] = []
    alloc = Allocator(
        Pool.from_counts({"localhost": 2}),
        RecordingSink(),
        virtual=True,
        drain_seconds=30.0,
        on_event=lambda job, kind, reason, message: warned.append(reason),
    )
    alloc.restore({"slow": place(0)}, [], {("localhost", 1): drain("slow", time.time() - 60)})
    alloc.request(Demand("other", 1, 1, 1, arrival=2))
    assert warned == ["DrainOverdue"], "given back a minute ago: overdue at once"


class AdoptingOperator(HerdOperator):
    """A real operator's adoption step, on parts the test made (no servers, no loop)."""

    def adopt(self, store: Store) -> Allocator:
        self.layout.create()
        engines = EngineDispatch(EngineContext(self.layout, ("localhost",)))
        allocator = Allocator(
            Pool.from_counts({"localhost": 4}), engines, virtual=True, drain_seconds=30.0
        )
        launcher = Launcher(Exits(), grace_seconds=2.0, records_dir=self.layout.launches_dir)
        self.launcher = launcher
        adopt(self.layout, store, allocator, launcher, engines, self.config.grace_seconds)
        return allocator


def workers_script(ready: Path, gpus: tuple[int, ...]) -> str:
    """A job's process that starts one "worker" per GPU, each with the shim's variables."""
    return (
        "import os, pathlib, subprocess, sys, time\n"
        f"procs = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " env={**os.environ, 'HERD_GPU': str(g), 'HOROVOD_LOCAL_RANK': str(i),"
        " 'HOROVOD_HOSTNAME': 'localhost'})"
        f" for i, g in enumerate({list(gpus)!r})]\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(120)\n"
    )


def test_the_operators_adoption_restores_placements_drains_and_live_workers(
    tmp_path: Path,
) -> None:
    """An operator killed while slow's GPUs 2 and 3 drained: the store says slow holds 0-1
    and GPU 2 drains (GPU 3's drain was never recorded); slow's workers still run on all
    four. The successor's adoption holds all four, with the workers' pids to watch, and
    removes the grants a previous operator left for jobs that no longer run."""
    config = OperatorConfig(
        specs_dir=tmp_path / "jobs",
        state_dir=tmp_path / "state",
        pool=StaticPool(Pool.from_counts({"localhost": 4}), True, "test pool"),
    )
    operator = AdoptingOperator(config)
    layout = operator.layout
    layout.create()
    store = Store(layout.database)
    store.record_spec("slow", "slow.yaml", herd_job("slow", gpus=(1, 4)), "f", 1.0)
    store.replace_allocations(
        {"slow": place(0, 1)}, 2.0, {("localhost", 2): drain("slow", time.time())}
    )
    first = Launcher(Exits(), grace_seconds=2.0, records_dir=layout.launches_dir)
    ready = tmp_path / "ready"
    first.launch(
        replace(
            request(tmp_path, workers_script(ready, (0, 1, 2, 3)), job="slow"),
            env={STATE_DIR_ENV: str(layout.root.resolve()), JOB_ENV: "slow"},
        )
    )
    wait_until(ready.exists, "the workers")
    layout.grants_dir.mkdir(parents=True, exist_ok=True)
    for leftover in ("slow.hosts", "gone.hosts", "gone.discover.sh"):
        (layout.grants_dir / leftover).write_text("localhost:1\n")
    try:
        allocator = operator.adopt(store)
        assert allocator.placements() == {"slow": place(0, 1)}
        assert allocator.draining() == {("localhost", 2): "slow", ("localhost", 3): "slow"}
        assert sorted((b.gpu, b.local_rank) for b in allocator.bindings()) == [(0, 0), (1, 1)]
        assert sorted(path.name for path in layout.grants_dir.iterdir()) == ["slow.hosts"]
        urgent = allocator.request(Demand("urgent", 2, 2, 2, priority=10, arrival=2))
        assert urgent is not None and not urgent.admitted
    finally:
        first.stop_all(timeout=10)
        assert operator.launcher is not None
        operator.launcher.stop_all(timeout=10)
        store.close()


def test_a_lost_group_gives_the_launcher_back_the_exits_the_group_recorded(
    tmp_path: Path, records: Path, launchers: list[Launcher]
) -> None:
    """`ExitsRecordedFirst`: a store group that cannot commit takes the status recording an
    exit with it, so the exit must be seen again by the reconcile that redoes it (not its
    record released, which would make the successor start the finished job again)."""
    store = Store(tmp_path / "state.db")
    launcher = launcher_on(records, launchers)
    info = launcher.launch(request(tmp_path, "raise SystemExit(3)"))
    wait_until(lambda: launcher.state("train").phase == ProcessPhase.EXITED, "the exit")
    grouped = ExitsRecordedFirst(store, launcher)
    with pytest.raises(StoreError), grouped.transaction():
        launcher.forget("train")  # the reconcile recorded the exit in its status...
        store._conn.execute("ROLLBACK")  # ...and the group is lost (a full disk)
    state = launcher.state("train")
    assert (state.phase, state.exit_code, state.launch) == (ProcessPhase.EXITED, 3, info)
    assert (records / "train.json").exists()

    with grouped.transaction():  # redone, and committed this time
        launcher.forget("train")
    assert not (records / "train.json").exists(), "released once the group committed"
    store.close()
