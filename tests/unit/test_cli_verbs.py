"""`apply`, `delete`, `suspend`, `resume` and `wait`: what they write into the spec
directory (whole, or not at all) and what they answer."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.cli.spec_files import with_suspend, write_spec_file
from herd_operator.cli.wait import WaitFor, duration, verdict, wait_for
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.specs import (
    Condition,
    ConditionStatus,
    ConditionType,
    HerdJob,
    is_spec_filename,
    load_spec_file,
    load_spec_text,
    scan_spec_dir,
    set_condition,
    spec_fingerprint,
)
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus
from tests.unit.test_cli import EXIT_FAILURE, EXIT_OK, make_job, run_cli, spec_yaml

Capture = pytest.CaptureFixture[str]


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs"
    directory.mkdir()
    return directory


def contents(directory: Path) -> dict[str, str]:
    """Every file of the directory (dotfiles too) and its text."""
    return {path.name: path.read_text() for path in sorted(directory.iterdir())}


def apply(capsys: Capture, specs: Path, *sources: str) -> tuple[int, str, str]:
    """`apply -f` each source (an argument starting with `--` is passed as it is)."""
    flags = [
        flag
        for source in sources
        for flag in ((source,) if source.startswith("--") else ("-f", source))
    ]
    return run_cli(capsys, "apply", "--specs-dir", str(specs), *flags)


# ---- apply ----


def test_apply_creates_then_says_unchanged_then_configured(
    tmp_path: Path, specs: Path, capsys: Capture
) -> None:
    source = tmp_path / "alpha.yaml"
    text = "# trains the vision model\n" + spec_yaml("alpha")
    source.write_text(text)

    assert apply(capsys, specs, str(source)) == (EXIT_OK, "herdjob/alpha created\n", "")
    written = specs / "alpha.yaml"
    assert written.read_text() == text  # comments and layout as the user wrote them
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask
    before = written.stat().st_mtime_ns

    assert apply(capsys, specs, str(source)) == (EXIT_OK, "herdjob/alpha unchanged\n", "")
    assert written.stat().st_mtime_ns == before  # not even rewritten

    source.write_text(spec_yaml("alpha", high=2))
    assert apply(capsys, specs, str(source), "--dry-run")[1] == (
        "herdjob/alpha configured (dry run)\n"
    )
    assert written.read_text() == text
    assert apply(capsys, specs, str(source)) == (EXIT_OK, "herdjob/alpha configured\n", "")
    job = load_spec_file(written).job
    assert job is not None and job.spec.gpus.max == 2
    assert sorted(os.listdir(specs)) == ["alpha.yaml"]  # no temporary file left


def test_apply_rewrites_the_file_that_declares_the_job_keeping_its_mode(
    tmp_path: Path, specs: Path, capsys: Capture
) -> None:
    existing = specs / "team-vision.yml"
    existing.write_text(spec_yaml("alpha"))
    existing.chmod(0o600)
    source = tmp_path / "new.yaml"
    source.write_text(spec_yaml("alpha", high=3))

    assert apply(capsys, specs, str(source)) == (EXIT_OK, "herdjob/alpha configured\n", "")

    assert sorted(os.listdir(specs)) == ["team-vision.yml"]
    assert existing.read_text() == spec_yaml("alpha", high=3)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600


def test_a_bad_file_among_several_writes_none_and_names_the_file_and_field(
    tmp_path: Path, specs: Path, capsys: Capture
) -> None:
    (specs / "alpha.yaml").write_text(spec_yaml("alpha"))
    before = contents(specs)
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "a.yaml").write_text(spec_yaml("alpha", high=2))
    (sources / "b.yaml").write_text(spec_yaml("beta"))
    bad = sources / "c.yaml"
    bad.write_text(spec_yaml("gamma", low=0))

    code, out, err = apply(capsys, specs, str(sources))

    assert (code, out) == (EXIT_FAILURE, "")
    assert err.splitlines() == [
        f"{bad}: spec.gpus.min: must be at least 1, got integer 0",
        "error: nothing applied: 1 problem(s); no spec file was written",
    ]
    assert contents(specs) == before


def test_apply_refuses_a_name_given_twice_and_a_file_name_taken_by_another_job(
    tmp_path: Path, specs: Path, capsys: Capture
) -> None:
    first, second = tmp_path / "1.yaml", tmp_path / "2.yaml"
    first.write_text(spec_yaml("alpha"))
    second.write_text(spec_yaml("alpha", high=2))
    code, _, err = apply(capsys, specs, str(first), str(second))
    assert code == EXIT_FAILURE and "'alpha' is also declared in 2.yaml" in err
    assert contents(specs) == {}

    (specs / "alpha.yaml").write_text(spec_yaml("other"))
    code, _, err = apply(capsys, specs, str(first))
    assert code == EXIT_FAILURE
    assert f"{specs / 'alpha.yaml'} exists and does not declare job 'alpha'" in err
    assert contents(specs) == {"alpha.yaml": spec_yaml("other")}


def test_apply_takes_stdin_and_a_list_saved_by_get(
    tmp_path: Path, specs: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    with Store(StateLayout(state).database) as store:
        for job in (make_job("train", 1, 2), make_job("idle", 2, 2)):
            store.record_spec(job.name, f"/old/{job.name}.yaml", job, spec_fingerprint(job), 1.0)
    code, saved, _ = run_cli(capsys, "get", "-o", "yaml", "--state-dir", str(state))
    assert code == EXIT_OK and yaml.safe_load(saved)["kind"] == "List"

    monkeypatch.setattr(sys, "stdin", io.StringIO(saved))
    code, out, err = apply(capsys, specs, "-")

    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == ["herdjob/idle created", "herdjob/train created"]
    written = yaml.safe_load((specs / "train.yaml").read_text())
    assert "status" not in written and "uid" not in written["metadata"]
    assert written["metadata"]["labels"] == {"team": "vision", "tier": "gpu"}
    job = load_spec_file(specs / "train.yaml").job
    assert job is not None and job.spec.gpus.max == 2
    # The same List, applied again, changes nothing.
    monkeypatch.setattr(sys, "stdin", io.StringIO(saved))
    assert apply(capsys, specs, "-")[1].splitlines() == [
        "herdjob/idle unchanged",
        "herdjob/train unchanged",
    ]


def test_apply_keeps_a_suspended_job_suspended_unless_the_spec_says_suspend(
    tmp_path: Path, specs: Path, capsys: Capture
) -> None:
    (specs / "alpha.yaml").write_text(spec_yaml("alpha"))
    run_cli(capsys, "suspend", "alpha", "--specs-dir", str(specs))
    source = tmp_path / "alpha.yaml"
    source.write_text(spec_yaml("alpha", high=2))

    assert apply(capsys, specs, str(source))[1] == "herdjob/alpha configured\n"
    job = load_spec_file(specs / "alpha.yaml").job
    assert job is not None and job.spec.suspend and job.spec.gpus.max == 2
    assert apply(capsys, specs, str(source))[1] == "herdjob/alpha unchanged\n"

    source.write_text(spec_yaml("alpha", high=2) + "  suspend: false\n")
    assert apply(capsys, specs, str(source))[1] == "herdjob/alpha configured\n"
    job = load_spec_file(specs / "alpha.yaml").job
    assert job is not None and not job.spec.suspend


def test_apply_needs_the_spec_directory(tmp_path: Path, capsys: Capture) -> None:
    source = tmp_path / "a.yaml"
    source.write_text(spec_yaml("alpha"))
    code, _, err = apply(capsys, tmp_path / "nowhere", str(source))
    assert code == EXIT_FAILURE and "does not exist" in err and "--specs-dir" in err


def test_validate_takes_what_apply_takes(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.yaml").write_text(spec_yaml("alpha") + "---\n" + spec_yaml("beta"))
    item = {**yaml.safe_load(spec_yaml("gamma")), "status": {"summary": "Running"}}
    saved = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [item]})
    monkeypatch.setattr(sys, "stdin", io.StringIO(saved))
    code, out, err = run_cli(capsys, "validate", str(tmp_path), "-")
    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == [
        f"{tmp_path / 'a.yaml'} (document 1): ok (alpha)",
        f"{tmp_path / 'a.yaml'} (document 2): ok (beta)",
        "- (items[0]): ok (gamma)",
    ]


# ---- the atomic write ----


CRASH_BEFORE_RENAME = """
import os, sys
from pathlib import Path
from herd_operator.cli.spec_files import with_suspend, write_spec_file
from herd_operator.cli.wait import WaitFor, duration, verdict, wait_for
write_spec_file(Path(sys.argv[1]), sys.argv[2], before_rename=lambda _: os._exit(9))
"""


def test_a_crash_between_the_write_and_the_rename_leaves_the_old_spec(specs: Path) -> None:
    path = specs / "alpha.yaml"
    path.write_text(spec_yaml("alpha"))
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_BEFORE_RENAME, str(path), spec_yaml("alpha", high=2)],
        check=False,
    )
    assert crashed.returncode == 9
    assert path.read_text() == spec_yaml("alpha")
    (left,) = [name for name in os.listdir(specs) if name != "alpha.yaml"]
    assert left.startswith(".alpha.yaml.") and not is_spec_filename(left)
    assert (specs / left).read_text() == spec_yaml("alpha", high=2)  # written, not renamed
    assert [spec_file.name for spec_file in scan_spec_dir(specs)] == ["alpha"]


def test_a_failed_write_leaves_the_old_spec_and_no_temporary_file(specs: Path) -> None:
    path = specs / "alpha.yaml"
    path.write_text(spec_yaml("alpha"))

    def fail(_: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_spec_file(path, spec_yaml("alpha", high=2), before_rename=fail)
    assert contents(specs) == {"alpha.yaml": spec_yaml("alpha")}


# ---- delete ----


def test_delete_removes_the_declaring_file_and_says_notfound_for_the_rest(
    specs: Path, capsys: Capture
) -> None:
    (specs / "a.yaml").write_text(spec_yaml("alpha"))
    (specs / "b.yaml").write_text(spec_yaml("beta"))
    code, out, err = run_cli(capsys, "delete", "alpha", "ghost", "--specs-dir", str(specs))
    assert code == EXIT_FAILURE
    assert out == 'herdjob "alpha" deleted\n'
    assert err == 'Error from server (NotFound): herdjobs "ghost" not found\n'
    assert sorted(os.listdir(specs)) == ["b.yaml"]


def test_delete_by_selector(specs: Path, capsys: Capture) -> None:
    labels = "  name: alpha\n  labels:\n    team: nlp\n"
    labelled = spec_yaml("alpha").replace("  name: alpha\n", labels)
    (specs / "a.yaml").write_text(labelled)
    (specs / "b.yaml").write_text(spec_yaml("beta"))
    argv = ["delete", "-l", "team=nlp", "--specs-dir", str(specs)]
    assert run_cli(capsys, *argv) == (EXIT_OK, 'herdjob "alpha" deleted\n', "")
    assert run_cli(capsys, *argv) == (EXIT_OK, "", "No resources found\n")
    assert sorted(os.listdir(specs)) == ["b.yaml"]
    code, _, err = run_cli(capsys, "delete", "--specs-dir", str(specs))
    assert code == EXIT_FAILURE and "name the jobs" in err


def test_delete_the_jobs_a_file_declares(tmp_path: Path, specs: Path, capsys: Capture) -> None:
    (specs / "a.yaml").write_text(spec_yaml("alpha"))
    (specs / "b.yaml").write_text(spec_yaml("beta"))
    (specs / "c.yaml").write_text(spec_yaml("gamma"))
    source = tmp_path / "applied.yaml"
    source.write_text(spec_yaml("alpha") + "---\n" + spec_yaml("gamma", low=0))
    code, out, err = run_cli(capsys, "delete", "-f", str(source), "--specs-dir", str(specs))
    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == ['herdjob "alpha" deleted', 'herdjob "gamma" deleted']
    assert sorted(os.listdir(specs)) == ["b.yaml"]


def test_delete_wait_waits_for_the_operator_to_forget_the_job(
    tmp_path: Path, specs: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    job = make_job("alpha", 1, 2)
    with Store(StateLayout(state).database) as store:
        store.record_spec("alpha", str(specs / "a.yaml"), job, spec_fingerprint(job), 1.0)
    (specs / "a.yaml").write_text(spec_yaml("alpha"))
    removals: list[float] = []

    def operator_forgets(seconds: float) -> None:  # the operator's reconcile, in the sleep
        with Store(StateLayout(state).database) as store:
            store.delete_job("alpha")
        removals.append(seconds)

    monkeypatch.setattr(time, "sleep", operator_forgets)
    argv = ["delete", "alpha", "--wait", "--specs-dir", str(specs), "--state-dir", str(state)]
    assert run_cli(capsys, *argv) == (EXIT_OK, 'herdjob "alpha" deleted\n', "")
    assert len(removals) == 1


# ---- suspend and resume ----


COMMENTED = """\
# vision team
apiVersion: herd/v1alpha1
kind: HerdJob
metadata:
  name: alpha
spec:
    # what runs
    command: [python, train.py]   # the script
    gpus: {min: 1, max: 4}
"""


def test_suspend_and_resume_edit_the_field_and_keep_the_rest(specs: Path, capsys: Capture) -> None:
    path = specs / "alpha.yaml"
    path.write_text(COMMENTED)
    path.chmod(0o640)

    assert run_cli(capsys, "suspend", "alpha", "--specs-dir", str(specs)) == (
        EXIT_OK,
        "herdjob/alpha suspended\n",
        "",
    )
    assert path.read_text() == COMMENTED.replace(
        "spec:\n    # what runs\n", "spec:\n    # what runs\n    suspend: true\n"
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert run_cli(capsys, "suspend", "alpha", "--specs-dir", str(specs))[1] == (
        "herdjob/alpha unchanged\n"
    )

    assert run_cli(capsys, "resume", "alpha", "--specs-dir", str(specs))[1] == (
        "herdjob/alpha resumed\n"
    )
    assert "    suspend: false\n" in path.read_text()
    job = load_spec_file(path).job
    assert job is not None and not job.spec.suspend and "# the script" in path.read_text()


def test_suspend_of_a_flow_style_spec_rewrites_it_whole(specs: Path, capsys: Capture) -> None:
    path = specs / "alpha.yaml"
    path.write_text(
        "{apiVersion: herd/v1alpha1, kind: HerdJob, metadata: {name: alpha},"
        " spec: {command: [python], gpus: {min: 1, max: 1}}}\n"
    )
    assert run_cli(capsys, "suspend", "alpha", "--specs-dir", str(specs))[0] == EXIT_OK
    job = load_spec_file(path).job
    assert job is not None and job.spec.suspend and job.spec.command == ["python"]


def test_suspend_refuses_unknown_names_and_invalid_files(specs: Path, capsys: Capture) -> None:
    broken = specs / "beta.yaml"
    broken.write_text(spec_yaml("beta", low=0))
    code, out, err = run_cli(capsys, "suspend", "ghost", "beta", "--specs-dir", str(specs))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err.splitlines() == [
        'Error from server (NotFound): herdjobs "ghost" not found',
        f"{broken}: spec.gpus.min: must be at least 1, got integer 0",
        f"error: {broken} is invalid: fix it first, then suspend or resume",
    ]
    assert broken.read_text() == spec_yaml("beta", low=0)


# ---- wait ----


def put_condition(state: Path, name: str, kind: ConditionType, reason: str, message: str) -> None:
    with Store(StateLayout(state).database) as store:
        record = store.get_job(name)
        assert record is not None
        conditions = set_condition(
            record.status.conditions, kind, ConditionStatus.TRUE, reason, message,
            record.generation, time.time(),
        )  # fmt: skip
        store.put_status(name, record.status.model_copy(update={"conditions": conditions}), 1.0)


@pytest.fixture
def waiting(tmp_path: Path) -> Path:
    """A store with one running job, `alpha`."""
    state = tmp_path / "state"
    job = make_job("alpha", 1, 2)
    with Store(StateLayout(state).database) as store:
        store.record_spec("alpha", "/jobs/alpha.yaml", job, spec_fingerprint(job), 1.0)
        store.put_status("alpha", HerdJobStatus(), 1.0)
    return state


def rounds(monkeypatch: pytest.MonkeyPatch, *changes: Callable[[], None]) -> list[float]:
    """wait's poll on a clock that moves only in its sleeps; each sleep makes the next change."""
    clock = [0.0]
    pending = list(changes)

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if pending:
            pending.pop(0)()

    monkeypatch.setattr("herd_operator.cli.wait._clock", lambda: clock[0])
    monkeypatch.setattr("herd_operator.cli.wait._sleep", sleep)
    return clock


def test_wait_exits_0_when_the_job_succeeds(
    waiting: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds(
        monkeypatch,
        lambda: put_condition(waiting, "alpha", ConditionType.Running, "Training", ""),
        lambda: put_condition(waiting, "alpha", ConditionType.Succeeded, "Completed", "ok"),
    )
    argv = ["wait", "alpha", "--for=condition=succeeded", "--state-dir", str(waiting)]
    assert run_cli(capsys, *argv) == (
        EXIT_OK,
        "herdjob/alpha condition=Succeeded=True: met\n",
        "",
    )


def test_wait_for_success_exits_1_at_once_with_the_reason_when_the_job_fails(
    waiting: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = rounds(
        monkeypatch,
        lambda: put_condition(
            waiting, "alpha", ConditionType.Failed, "BackoffLimitExceeded", "exited with status 1"
        ),
    )
    argv = ["wait", "alpha", "--for", "condition=Succeeded", "--timeout", "1h"]
    code, out, err = run_cli(capsys, *argv, "--state-dir", str(waiting))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == (
        "error: herdjob/alpha Failed: BackoffLimitExceeded: exited with status 1"
        " (waited for condition=Succeeded=True)\n"
    )
    assert clock[0] == 0.5  # one round, not the hour


def test_wait_times_out_with_124_and_one_line(
    waiting: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = rounds(monkeypatch)
    argv = ["wait", "alpha", "--for=condition=Succeeded", "--timeout=2s"]
    code, out, err = run_cli(capsys, *argv, "--state-dir", str(waiting))
    assert (code, out) == (124, "")
    assert err == (
        "error: timed out after 2s waiting for condition=Succeeded=True on herdjob/alpha\n"
    )
    assert clock[0] == 2.0


def test_wait_for_a_name_nobody_declared_is_notfound(
    waiting: Path, capsys: Capture, tmp_path: Path
) -> None:
    argv = ["wait", "ghost", "--for=condition=Succeeded", "--state-dir", str(waiting)]
    code, _, err = run_cli(capsys, *argv, "--specs-dir", str(tmp_path))
    assert code == EXIT_FAILURE
    assert err == 'Error from server (NotFound): herdjobs "ghost" not found\n'


def test_wait_for_a_job_applied_but_not_yet_recorded_waits_for_it(
    waiting: Path, specs: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (specs / "beta.yaml").write_text(spec_yaml("beta"))
    job = make_job("beta", 1, 4)

    def recorded_and_running() -> None:
        with Store(StateLayout(waiting).database) as store:
            store.record_spec("beta", str(specs / "beta.yaml"), job, spec_fingerprint(job), 1.0)
        put_condition(waiting, "beta", ConditionType.Running, "Training", "")

    rounds(monkeypatch, recorded_and_running)
    argv = ["wait", "beta", "--for=condition=Running", "--specs-dir", str(specs)]
    code, out, _ = run_cli(capsys, *argv, "--state-dir", str(waiting))
    assert (code, out) == (EXIT_OK, "herdjob/beta condition=Running=True: met\n")


def test_wait_for_a_job_whose_spec_is_invalid_says_so_at_once(
    waiting: Path, specs: Path, capsys: Capture
) -> None:
    (specs / "beta.yaml").write_text(spec_yaml("beta", low=0))
    argv = ["wait", "beta", "--for=condition=Running", "--specs-dir", str(specs)]
    code, out, err = run_cli(capsys, *argv, "--state-dir", str(waiting))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == (
        "error: herdjob/beta is not run: its spec is invalid"
        f" ({specs / 'beta.yaml'}: spec.gpus.min: must be at least 1, got integer 0)\n"
    )


def test_wait_for_delete_and_a_job_deleted_while_awaited(
    waiting: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def deleted() -> None:
        with Store(StateLayout(waiting).database) as store:
            store.delete_job("alpha")

    rounds(monkeypatch, deleted)
    argv = ["wait", "alpha", "--for=condition=Succeeded", "--state-dir", str(waiting)]
    assert run_cli(capsys, *argv) == (EXIT_FAILURE, "", "error: herdjob/alpha was deleted\n")
    argv = ["wait", "alpha", "--for=delete", "--state-dir", str(waiting)]
    assert run_cli(capsys, *argv) == (EXIT_OK, "herdjob/alpha deleted\n", "")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--for=condition=Done"], "expected condition=TYPE[=True|False] or delete"),
        (["--for=condition=Succeeded", "--timeout=5x"], "is not a duration"),
        (["--for=condition=Succeeded", "--timeout=0s"], "must be positive"),
    ],
)
def test_wait_usage_errors(argv: list[str], message: str, capsys: Capture) -> None:
    with pytest.raises(SystemExit) as caught:
        run_cli(capsys, "wait", "alpha", *argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_suspend_refuses_a_job_that_finished(tmp_path: Path, specs: Path, capsys: Capture) -> None:
    state = tmp_path / "state"
    job = make_job("alpha", 1, 2)
    with Store(StateLayout(state).database) as store:
        store.record_spec("alpha", str(specs / "alpha.yaml"), job, spec_fingerprint(job), 1.0)
    put_condition(state, "alpha", ConditionType.Succeeded, "Completed", "")
    (specs / "alpha.yaml").write_text(spec_yaml("alpha"))

    argv = ["suspend", "alpha", "--specs-dir", str(specs), "--state-dir", str(state)]
    assert run_cli(capsys, *argv) == (
        EXIT_FAILURE,
        "",
        "error: herdjob/alpha Succeeded: a finished job is not suspended\n",
    )
    assert (specs / "alpha.yaml").read_text() == spec_yaml("alpha")


def job_record(generation: int, *conditions: tuple[ConditionType, str, int]) -> JobRecord:
    """A record at `generation` whose conditions are (type, status, observed generation)."""
    job = make_job("alpha", 1, 2)
    status = HerdJobStatus(
        conditions=tuple(
            Condition(
                type=kind, status=ConditionStatus(value), reason="Because",
                message="why", last_transition_time=1.0, observed_generation=observed,
            )
            for kind, value, observed in conditions
        )
    )  # fmt: skip
    return JobRecord("alpha", "uid", "/jobs/a.yaml", "f", generation, status, 1.0, 1.0, lambda: job)


SUCCEEDED = wait_for("condition=Succeeded")
NOT_RUNNING = wait_for("condition=Running=false")


@pytest.mark.parametrize(
    ("record", "wanted", "code"),
    [
        (job_record(1), SUCCEEDED, None),
        (job_record(1, (ConditionType.Succeeded, "True", 1)), SUCCEEDED, EXIT_OK),
        (job_record(1, (ConditionType.Failed, "True", 1)), SUCCEEDED, EXIT_FAILURE),
        # Ended for an older spec: the operator runs the new one, so wait on.
        (job_record(2, (ConditionType.Failed, "True", 1)), SUCCEEDED, None),
        (job_record(2, (ConditionType.Succeeded, "True", 1)), SUCCEEDED, None),
        (job_record(1, (ConditionType.Succeeded, "True", 1)), wait_for("condition=Failed"), 1),
        (job_record(1, (ConditionType.Running, "False", 1)), NOT_RUNNING, EXIT_OK),
        (job_record(1, (ConditionType.Running, "True", 1)), NOT_RUNNING, None),
        (job_record(1, (ConditionType.Failed, "True", 1)), wait_for("condition=Running"), 1),
        (job_record(1, (ConditionType.Failed, "True", 1)), wait_for("condition=failed"), 0),
        (None, SUCCEEDED, EXIT_FAILURE),
        (None, wait_for("delete"), EXIT_OK),
        (job_record(1, (ConditionType.Succeeded, "True", 1)), wait_for("delete"), None),
    ],
)
def test_wait_verdict(record: JobRecord | None, wanted: WaitFor, code: int | None) -> None:
    answer = verdict(record, wanted, "alpha")
    assert (answer.code if answer is not None else None) == code


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("1.5", 1.5), ("5m", 300.0), ("1h30m", 5400.0), ("2d", 172800.0),
     ("250ms", 0.25)],
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert duration(text) == seconds


def unsuspended(job: HerdJob) -> dict[str, object]:
    spec = job.spec.model_copy(update={"suspend": False})
    return job.model_copy(update={"spec": spec}).model_dump()


@settings(max_examples=60, deadline=None)
@given(
    indent=st.sampled_from([2, 4]),
    flow=st.sampled_from([False, None, True]),
    before=st.sampled_from([None, True, False]),
    comment=st.booleans(),
    suspend=st.booleans(),
)
def test_the_suspend_edit_gives_the_same_job_but_for_suspend_in_any_layout(
    indent: int, flow: bool | None, before: bool | None, comment: bool, suspend: bool
) -> None:
    document = yaml.safe_load(spec_yaml("alpha"))
    document["metadata"]["labels"] = {"team": "nlp"}
    if before is not None:
        document["spec"]["suspend"] = before
    text = yaml.safe_dump(document, indent=indent, default_flow_style=flow, sort_keys=False)
    if comment:
        text = "# a comment\n" + text
    job = load_spec_text(text, "alpha.yaml").job
    assert job is not None

    edited = with_suspend(text, job, suspend, "alpha.yaml")

    loaded = load_spec_text(edited, "alpha.yaml").job
    assert loaded is not None and loaded.spec.suspend == suspend
    assert unsuspended(loaded) == unsuspended(job)
    if comment and not flow:
        assert edited.startswith("# a comment\n")  # edited in place, not written anew
