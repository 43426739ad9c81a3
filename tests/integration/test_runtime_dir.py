"""The operator's runtime directory: made on start, recorded, used again after a crash (the
jobs it adopts read their grants there), removed on a clean stop."""

from __future__ import annotations

from pathlib import Path

from herd_operator.layout import RUNTIME_PREFIX, make_runtime_dir
from tests.integration.harness import operator_harness


def test_grants_go_to_a_private_runtime_dir_that_goes_away_with_the_operator(
    tmp_path: Path,
) -> None:
    base = tmp_path / "runtime"
    # What a crashed operator left: its runtime directory, named in the record.
    crashed = make_runtime_dir(base)
    (crashed / "grants").mkdir()
    (crashed / "grants" / "old.hosts").write_text("localhost:4\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "runtime-dir").write_text(f"{crashed}\n")

    with operator_harness(tmp_path, runtime_dir=base) as herd:
        layout = herd.layout
        assert layout.runtime == crashed, "a crashed operator's runtime dir is used again"
        assert layout.grants_dir.is_dir()
        assert Path((state / "runtime-dir").read_text().strip()) == layout.runtime
        assert not (crashed / "grants" / "old.hosts").exists(), "no job runs that read it"
        assert not (state / "grants").exists()

    assert not crashed.exists(), "removed on a clean stop"
    assert not (state / "runtime-dir").exists()

    with operator_harness(tmp_path, runtime_dir=base) as herd:
        runtime = herd.layout.runtime
        assert runtime is not None and runtime.parent == base and runtime != crashed
        assert runtime.name.startswith(RUNTIME_PREFIX)
    assert not runtime.exists()
