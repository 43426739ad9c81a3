"""Tests for herd_operator.layout: where grants live, and the runtime directory's life."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from herd_operator import layout as layout_module
from herd_operator.layout import (
    RUNTIME_PREFIX,
    StateLayout,
    make_runtime_dir,
    remove_runtime_dir,
    runtime_base,
)


def test_grants_live_in_the_runtime_dir_when_there_is_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert StateLayout(state).grant_file("a") == state / "grants" / "a.hosts"
    runtime = tmp_path / "rt"
    in_runtime = StateLayout(state, runtime)
    assert in_runtime.grant_file("a") == runtime / "grants" / "a.hosts"
    assert in_runtime.discovery_script("a") == runtime / "grants" / "a.discover.sh"
    assert in_runtime.database == state / "state.db"  # everything else stays in the state dir


def test_runtime_base_prefers_the_request_then_xdg_then_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xdg, shm = tmp_path / "xdg", tmp_path / "shm"
    xdg.mkdir()
    shm.mkdir()
    monkeypatch.setattr(layout_module, "SHARED_MEMORY", shm)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_base(tmp_path / "asked") == tmp_path / "asked"
    assert runtime_base(None) == xdg
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert runtime_base(None) == shm
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_base(None) == shm
    monkeypatch.setattr(layout_module, "SHARED_MEMORY", tmp_path / "no-shm")
    assert runtime_base(None) is None


def test_runtime_dirs_are_private_and_distinct(tmp_path: Path) -> None:
    first, second = make_runtime_dir(tmp_path / "base"), make_runtime_dir(tmp_path / "base")
    assert first != second
    for made in (first, second):
        assert made.parent == tmp_path / "base" and made.name.startswith(RUNTIME_PREFIX)
        assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_only_a_runtime_dir_of_this_user_is_removed(tmp_path: Path) -> None:
    ours = make_runtime_dir(tmp_path)
    (ours / "grants").mkdir()
    (ours / "grants" / "a.hosts").write_text("localhost:2\n")
    remove_runtime_dir(ours)
    assert not ours.exists()
    remove_runtime_dir(ours)  # already gone: nothing to do

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    link = tmp_path / f"{RUNTIME_PREFIX}link"
    link.symlink_to(precious)
    remove_runtime_dir(link)  # a link named like ours is not followed
    remove_runtime_dir(precious)  # not named like ours
    assert (precious / "data").read_text() == "keep"
    assert link.is_symlink()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_a_runtime_dir_of_another_user_is_left_alone(tmp_path: Path) -> None:
    theirs = tmp_path / f"{RUNTIME_PREFIX}theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    remove_runtime_dir(theirs)
    assert theirs.is_dir()


def test_the_state_dir_is_made_private_whatever_existed_before(tmp_path: Path) -> None:
    """A state dir that already existed as 0755 once stayed readable by every local user."""
    root = tmp_path / "state"
    for directory in (root, root / "logs", root / "prometheus"):
        directory.mkdir(parents=True)
        directory.chmod(0o755)
    StateLayout(root).create()
    for directory in (root, root / "logs", root / "prometheus"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_a_job_named_agent_has_its_own_key_file(tmp_path: Path) -> None:
    layout = StateLayout(tmp_path)
    job_files = {layout.job_token_file("agent"), layout.job_env_file("agent")}
    assert layout.agent_token_file("agent") not in job_files
    assert layout.agent_token_file("agent") != layout.legacy_agent_token_file
    assert all(path.parent == layout.secrets_dir for path in job_files)
