"""The foreign-client probe's own arithmetic and argument checks (devtools/foreign_client_probe.py;
the probe itself needs a third party's script and minutes of CPU: docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.foreign_client_probe import CASES, Observation, foreign_command, main, recovery_times


def test_recovery_counts_from_the_fault_to_the_next_epoch_and_to_the_first_at_full_size() -> None:
    seen = Observation(
        epochs=[
            {"t": 10.0, "epoch": 0, "size": 3},
            {"t": 25.0, "epoch": 1, "size": 2},
            {"t": 40.0, "epoch": 2, "size": 3},
        ],
        fault_at=20.0,
    )
    assert recovery_times(seen) == (5.0, 20.0)
    assert recovery_times(Observation(epochs=seen.epochs)) == (None, None)


def test_the_exit_schedule_keys_are_what_the_script_looks_up() -> None:
    # The script looks up str((epoch, batch)) in the JSON it is given.
    for case in CASES.values():
        command = foreign_command(Path("/x.py"), case, Path("/log"))
        schedule = json.loads(command[command.index("--exit-schedule") + 1])
        assert all(key == str(tuple(json.loads(f"[{key[1:-1]}]"))) for key in schedule)
        assert command[command.index("--exit-mode") + 1] in ("exception", "kill")


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["--script", "/no/such/script.py"], "--script"), (["--cases", "az"], "--cases")],
)
def test_bad_arguments_are_refused_naming_the_flag(
    tmp_path: Path, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    if "--script" not in argv:
        argv = ["--script", str(script), *argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
