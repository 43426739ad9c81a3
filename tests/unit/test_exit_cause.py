"""The error a failed launch's driver printed, from the job's log (pure)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from herd_operator.controllers.ports import ProcessPhase
from herd_operator.runtime.exit_cause import MAX_ERROR_CHARS, driver_error
from herd_operator.runtime.launcher import Launcher, LaunchRequest
from herd_operator.specs import HerdJobSpec


def test_the_drivers_last_error_line_is_the_cause_with_the_lines_that_continue_it() -> None:
    lines = [
        "2026-12-02T13:22:19.338Z herd-driver: starting worker localhost[0] as rank 0 of 3",
        "[0]<stderr>:  what():  Wait timeout after 5 seconds for key(s): 2.",
        "Process 0 exit with status code 134.",
        "herd-driver: Horovod detected that one or more processes exited with non-zero status,"
        " thus causing the job to be terminated. The first process to do so was:",
        "Process name: localhost[0]",
        "Exit code: 134",
        "",
        "[1]<stderr>: a worker's line after it",
    ]
    assert driver_error(lines) == (
        "Horovod detected that one or more processes exited with non-zero status, thus causing"
        " the job to be terminated. The first process to do so was: Process name: localhost[0]"
        " Exit code: 134"
    )


def test_worker_lines_and_the_drivers_time_stamped_log_lines_are_not_its_error() -> None:
    lines = [
        "2026-12-02T13:22:47.462Z herd-driver: the workers' first meeting failed: ...",
        "[0]<stderr>:herd-driver: printed by a worker",
        "  herd-driver: indented",
    ]
    assert driver_error(lines) == ""
    assert driver_error([]) == ""


def test_the_last_error_wins_and_a_long_one_is_cut() -> None:
    assert driver_error(["herd-driver: first", "herd-torchrun: second"]) == "second"
    long = driver_error(["herd-driver: " + "x" * 1000])
    assert len(long) == MAX_ERROR_CHARS and long.endswith("...")


def test_a_failed_launch_s_state_carries_its_driver_s_error_from_its_log(tmp_path: Path) -> None:
    driver = (
        "import sys; print('herd-driver: the grant file is gone', file=sys.stderr); sys.exit(1)"
    )
    launcher = Launcher(grace_seconds=1)
    try:
        request = LaunchRequest(
            job="train",
            generation=1,
            argv=[sys.executable, "-c", driver],
            log_file=tmp_path / "train.log",
            command="hvd-driver",
            spec=HerdJobSpec.model_validate({"command": ["python"], "gpus": {"min": 1, "max": 1}}),
        )
        launcher.launch(request)
        deadline = time.monotonic() + 60  # a hang guard
        while (state := launcher.state("train")).phase != ProcessPhase.EXITED:
            assert time.monotonic() < deadline, "the launch did not exit"
            time.sleep(0.05)
    finally:
        launcher.stop_all(timeout=10)
    assert state.exit_code == 1 and state.error == "the grant file is gone"
