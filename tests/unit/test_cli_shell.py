"""The command line as scripts and shells use it (issue 28.4): one-line usage errors as
kubectl's, `get --sort-by`, `-L`/`--show-labels`, `-l ''`, the EPOCH column, and shell
completion."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from herd_operator.cli import main
from herd_operator.cli.demo import summary
from herd_operator.cli.sorting import SortKeyError, parse_sort_key, sort_by
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.specs import HerdJob, spec_fingerprint
from herd_operator.specs.status import HerdJobStatus
from tests.unit.test_cli import run_cli

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must be refused as a usage error; returns its stderr."""
    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    assert caught.value.code == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


# ---- usage errors ----


@pytest.mark.parametrize(
    ("argv", "error", "command"),
    [
        (["get", "--bogus"], "unrecognized arguments: --bogus", "get"),
        (["--bogus", "events"], "unrecognized arguments: --bogus", "events"),
        (["get", "-o", "csv"], "argument -o/--output: invalid choice: 'csv'", "get"),
        (["events", "--limit", "0"], "argument --limit: must be at least 1, got 0", "events"),
        (["logs"], "the following arguments are required: NAME", "logs"),
        (["describe", "a", "b"], "unrecognized arguments: b", "describe"),
        (["report", "--dpi", "5"], "argument --dpi: a resolution is 30..1200 dpi, got 5", "report"),
        ([], "the following arguments are required: COMMAND", None),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'", None),
    ],
)
def test_a_usage_error_is_one_line_and_where_help_is(
    capsys: pytest.CaptureFixture[str], argv: list[str], error: str, command: str | None
) -> None:
    err = usage_error(capsys, *argv)
    first, second, *rest = err.split("\n")
    assert first.startswith(f"error: {error}"), err
    prog = "herd-operator" + (f" {command}" if command else "")
    assert (second, rest) == (f"See '{prog} --help'.", [""]), err
    assert "usage:" not in err


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["get", "--help"])
    assert caught.value.code == EXIT_OK
    assert capsys.readouterr().out.startswith("usage: herd-operator get ")


# ---- get: -l '', --sort-by, -L, --show-labels, EPOCH ----


def add_labelled(store: Store, name: str, labels: dict[str, str], created: float) -> None:
    job = HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name, "labels": labels},
            "spec": {"command": ["python", "t.py"], "gpus": {"min": 1, "max": 2}},
        }
    )
    store.record_spec(name, f"/jobs/{name}.yaml", job, spec_fingerprint(job), created)


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    """Three jobs: `b` oldest, `c` with 3 restarts, `a` newest; labels team/tier."""
    state_dir = tmp_path / "state"
    now = time.time()
    with Store(StateLayout(state_dir).database) as store:
        add_labelled(store, "b", {"team": "vision", "tier": "batch"}, now - 300)
        add_labelled(store, "c", {"team": "nlp"}, now - 200)
        add_labelled(store, "a", {}, now - 100)
        store.put_status("c", HerdJobStatus(restarts=3, epoch=23), now)
    return state_dir


def names(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:]]


def test_an_empty_selector_matches_every_job(
    labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "get", "-l", "", "-o", "name", "--state-dir", str(labelled))
    assert (code, out.split()) == (EXIT_OK, ["herdjob/a", "herdjob/b", "herdjob/c"])


@pytest.mark.parametrize(
    ("key", "order"),
    [
        (".metadata.name", ["a", "b", "c"]),
        ("{.metadata.creationTimestamp}", ["b", "c", "a"]),  # oldest first, as kubectl
        ("age", ["b", "c", "a"]),
        ("RESTARTS", ["a", "b", "c"]),  # 0, 0, 3: equal keys keep the name order
        ("metadata.labels.team", ["c", "b", "a"]),  # nlp, vision, then the job without
        (".status.epoch", ["c", "a", "b"]),  # unset (null) last
    ],
)
def test_sort_by_a_field_or_a_column(
    labelled: Path, capsys: pytest.CaptureFixture[str], key: str, order: list[str]
) -> None:
    code, out, err = run_cli(capsys, "get", "--sort-by", key, "--state-dir", str(labelled))
    assert (code, err) == (EXIT_OK, "")
    assert names(out) == order
    # The same order in every output.
    code, out, _ = run_cli(
        capsys, "get", "--sort-by", key, "-o", "json", "--state-dir", str(labelled)
    )
    assert [item["metadata"]["name"] for item in json.loads(out)["items"]] == order


def test_a_sort_key_no_job_has_is_a_usage_error(
    labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "get", "--sort-by", ".spec.gpuz", "--state-dir", str(labelled))
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith("error: --sort-by '.spec.gpuz': no job has this field; allowed:")
    assert err.endswith("\nSee 'herd-operator get --help'.\n")


@pytest.mark.parametrize("text", ["", "..a", ".a b", ".a[x]", "{.a", "a/b"])
def test_a_malformed_sort_key_is_refused(text: str) -> None:
    with pytest.raises(SortKeyError, match="is not a sort key; allowed: a field"):
        parse_sort_key(text)


def test_sort_key_paths_with_list_indexes() -> None:
    key = parse_sort_key("{.status.placement[1].host}")
    assert key.steps == ("status", "placement", 1, "host")
    objects = [
        {"status": {"placement": [{"host": "n1"}, {"host": "n9"}]}},
        {"status": {"placement": [{"host": "n2"}]}},  # too short: sorts last
        {"status": {"placement": [{"host": "n1"}, {"host": "n3"}]}},
    ]
    assert sort_by([0, 1, 2], key, lambda i: objects[i]) == [2, 0, 1]


def test_label_columns_and_show_labels(labelled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "get", "-L", "team", "-L", "tier", "--show-labels", "--state-dir", str(labelled)
    )
    assert code == EXIT_OK
    header, a, b, c = out.splitlines()
    assert header.split()[-3:] == ["TEAM", "TIER", "LABELS"]
    assert a.split()[-1] == "<none>"
    assert b.split()[-3:] == ["vision", "batch", "team=vision,tier=batch"]
    assert c.split()[-2:] == ["nlp", "team=nlp"]
    assert header.index("LABELS") == b.index("team=vision")  # aligned


def test_a_bad_label_column_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "get", "-L", "Team Name")
    assert err.startswith("error: argument -L/--label-columns: 'Team Name': 'Team Name' is not")


def test_epoch_is_epochs_completed_in_get_describe_and_the_demo_summary(
    labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job `c` reported epoch 23 last (counted from 0): 24 epochs done, said alike."""
    code, out, _ = run_cli(capsys, "get", "c", "-o", "wide", "--state-dir", str(labelled))
    assert code == EXIT_OK
    header, row = out.splitlines()
    assert row.split()[header.split().index("EPOCH")] == "24"
    code, out, _ = run_cli(capsys, "describe", "c", "--state-dir", str(labelled))
    assert code == EXIT_OK
    assert "Epochs done:  24" in out.splitlines()
    rows = summary(StateLayout(labelled).database, time.monotonic()).splitlines()
    table_header = next(line for line in rows if line.startswith("JOB"))
    row = next(line for line in rows if line.startswith("c "))
    assert row.split()[table_header.split().index("EPOCHS")] == "24"


# ---- completion ----


def completion(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == EXIT_OK
    return capsys.readouterr().out


def test_the_bash_script_names_every_command_and_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = completion("bash", capsys)
    commands = next(line for line in script.splitlines() if "_subparsers=(" in line)
    for command in ("run", "get", "describe", "events", "logs", "report", "validate", "completion"):
        assert f" {command} " in commands.replace("(", " ").replace(")", " "), commands
    assert "--sort-by" in script and "--show-labels" in script and "--log-format" in script
    assert script.rstrip().endswith("complete -o bashdefault -F _shtab_herd_operator herd-operator")


def bash_complete(script: Path, words: list[str]) -> list[str]:
    """What bash offers for the last of `words` (the script loaded, as a shell would)."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    quoted = " ".join(f"'{word}'" for word in words)
    probe = (
        f"source '{script}'\n"
        f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}\n"
        'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}\n'
        '_shtab_herd_operator herd-operator "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    # herd-operator itself is found beside this Python (the job names come from it).
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(script.parent)}
    done = subprocess.run(
        [bash, "--norc", "--noprofile", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return sorted(done.stdout.split())  # as bash shows them


def test_bash_completes_commands_flags_and_job_names(
    labelled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "herd-operator.bash"
    script.write_text(completion("bash", capsys))
    assert bash_complete(script, ["herd-operator", "de"]) == ["delete", "demo", "describe"]
    assert bash_complete(script, ["herd-operator", "get", "--sh"]) == ["--show-labels"]
    assert bash_complete(script, ["herd-operator", "report", "--format", "c"]) == ["csv"]
    # Directories for --state-dir (a file is not one).
    (tmp_path / "runs").mkdir()
    (tmp_path / "runfile").write_text("")
    assert bash_complete(script, ["herd-operator", "get", "--state-dir", f"{tmp_path}/ru"]) == [
        f"{tmp_path}/runs"
    ]
    # Job names, from the state dir given on the line.
    words = ["herd-operator", "--state-dir", str(labelled), "describe", ""]
    assert bash_complete(script, words) == ["a", "b", "c"]


def test_zsh_completion_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    out = completion("zsh", capsys)
    assert out.startswith("#compdef herd-operator")
    assert "describe" in out and "_herd_operator_jobs" in out


def test_an_unknown_shell_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "completion", "fish")
    assert err.startswith("error: argument SHELL: invalid choice: 'fish'")
