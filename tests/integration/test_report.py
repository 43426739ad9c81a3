"""`herd-operator report` on a real run: a job that succeeds, one that fails, one deleted while
it runs, and one resized then stopped with the operator. The GPU-seconds it reports are
those the events tell, and the figure files open."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from herd_operator.cli import main
from herd_operator.cli.report.figure_data import grant_steps, pool_stack
from herd_operator.cli.report.series import job_sources, load_run
from herd_operator.runtime.store import Event
from tests.integration.harness import digits_command, operator_harness, spec_document

POOL = 5
PLAIN = ["python", "examples/train_plain.py", "--step-delay", "0.02"]
STARTED = re.compile(r" with (\d+) workers$")
RESIZED = re.compile(r"^(\d+) -> (\d+) GPUs")
ENDS = {"Completed", "Failed", "Deleted", "Stopped"}
"""Events that end a job's hold on its GPUs (with `restartPolicy.onFailure` off)."""


def held_by_events(events: list[Event], end: float) -> float:
    """GPU-seconds of one job as its events tell them: `Started ... with N workers` grants
    N, `Resized A -> B GPUs` grants B, and an end event gives everything back."""
    total, level, since = 0.0, 0, 0.0
    for event in events:
        started = STARTED.search(event.message) if event.reason == "Started" else None
        resized = RESIZED.match(event.message) if event.reason == "Resized" else None
        if started is None and resized is None and event.reason not in ENDS:
            continue
        total += level * (event.time - since)
        since = event.time
        if started is not None:
            level = int(started.group(1))
        elif resized is not None:
            level = int(resized.group(2))
        else:
            level = 0
    return total + level * (end - since)


def test_report_counts_what_the_events_say_and_draws_every_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with operator_harness(tmp_path, gpus=POOL) as herd:
        herd.write_spec(spec_document("succeeds", 1, 1, [*PLAIN, "--epochs", "2", "--steps", "5"]))
        crash = ["python", "-c", "import sys; sys.exit(3)"]
        herd.write_spec(spec_document("fails", 1, 1, crash, restartPolicy={"onFailure": False}))
        herd.write_spec(spec_document("deleted", 1, 1, [*PLAIN, "--epochs", "1000"]))
        resized = spec_document("resized", 1, 2, digits_command(400, "--step-delay", "0.02"))
        herd.write_spec(resized)

        def true(name: str, condition: str) -> bool:
            found = herd.condition(name, condition)
            return found is not None and found["status"] == "True"

        herd.wait_for(lambda: true("fails", "Failed"), "the crashing job to fail", job="fails")
        herd.wait_for(
            lambda: (herd.job("resized") or {}).get("gpus", {}).get("active") == 2,
            "2 workers of the elastic job reporting",
            job="resized",
        )
        herd.wait_for(lambda: true("deleted", "Running"), "the job to delete to run", job="deleted")
        herd.wait_for(
            lambda: true("succeeds", "Succeeded"), "the short job to succeed", job="succeeds"
        )
        # A live resize: a lower max shrinks the grant without a relaunch.
        resized["spec"]["gpus"]["max"] = 1
        herd.write_spec(resized)
        herd.wait_for(
            lambda: any(e.reason == "Resized" for e in herd.events("resized")),
            "the elastic job to shrink",
            job="resized",
        )
        (herd.specs_dir / "deleted.yaml").unlink()
        herd.wait_for(
            lambda: any(e.reason == "Deleted" for e in herd.events("deleted")),
            "the deleted job to be removed",
            job="deleted",
        )
    # The operator stopped: `resized` ended with it.
    state = herd.layout.root

    with herd.store() as store, store.snapshot():
        sources = job_sources(store)
        run = load_run(store, state, sources, since=None)
        events = {source.name: list(source.events) for source in sources}
    by_name = {job.name: job for job in run.jobs}
    assert sorted(by_name) == ["deleted", "fails", "resized", "succeeds"]
    statuses = {name: job.status for name, job in by_name.items()}
    assert statuses == {
        "deleted": "Deleted",
        "fails": "Failed",
        "resized": "OperatorStopped",
        "succeeds": "Succeeded",
    }
    assert run.pool == ((0.0, POOL),) and not run.pool_inferred
    end = run.origin + run.end
    for name, job in by_name.items():
        expected = held_by_events(events[name], end)
        assert job.gpu_seconds(run.end) == pytest.approx(expected, abs=0.01), name
        # Every job ended, and its line says so: it ends at 0.
        assert grant_steps(job, run.end)[1][-1] == 0, name
    assert by_name["resized"].resizes() == 1
    assert sum(job.gpu_seconds(run.end) for job in run.jobs) <= POOL * run.end
    stack = pool_stack(run)
    for index, size in enumerate(stack.pool):
        assert sum(levels[index] for levels in stack.granted) + stack.draining[index] <= size

    # The command says the same, rounded, and writes each format.
    code = main(["report", "--state-dir", str(state), "--format", "text"])
    table = capsys.readouterr().out
    assert code == 0
    for name, job in by_name.items():
        row = next(line.split() for line in table.splitlines() if line.startswith(name + " "))
        assert row[4] == f"{job.gpu_seconds(run.end):.0f}", row
    magic = {"png": b"\x89PNG\r\n\x1a\n", "svg": b"<?xml", "pdf": b"%PDF-"}
    for kind, start in magic.items():
        output = tmp_path / f"timeline.{kind}"
        assert main(["report", "--state-dir", str(state), "--output", str(output)]) == 0
        assert output.read_bytes().startswith(start), kind
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is not None:  # scripts/bootstrap.sh installs it (poppler-utils)
        page = tmp_path / "page"
        subprocess.run(
            [
                pdftoppm,
                "-png",
                "-r",
                "30",
                "-singlefile",
                str(tmp_path / "timeline.pdf"),
                str(page),
            ],
            check=True,
            timeout=60,
        )
        assert (tmp_path / "page.png").read_bytes().startswith(magic["png"])
