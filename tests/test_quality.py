"""The code base stays lint-clean, typed, and layered (dependencies point one way)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
        ["lint-imports"],
    ],
    ids=["ruff", "ruff-format", "mypy", "import-layers"],
)
def test_tool_is_clean(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


PRODUCT = ("herd_operator", "specs", "policies", "controllers", "exporters")


def _product_files() -> list[Path]:
    """The product's modules, once each (herd_operator/<name> links to the top-level folders)."""
    files = [path for path in (REPO / "herd_operator").rglob("*.py") if not path.is_symlink()]
    seen = {path.resolve() for path in files}
    for name in PRODUCT[1:]:
        files += [p for p in (REPO / name).rglob("*.py") if p.resolve() not in seen]
    return sorted(set(files))


def test_no_private_name_is_imported_from_another_module() -> None:
    """A name with a leading underscore belongs to its module: what another module needs is
    made public there (or the two belong together)."""
    offenders = []
    for path in _product_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("herd_operator"):
                offenders += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert offenders == []


def test_the_plugin_api_is_what_the_example_plugin_imports() -> None:
    """docs/policies.md tells plug-in authors to import from herd_operator.policies.api only;
    the example plug-in does, and every name of its __all__ is there."""
    from herd_operator.policies import api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    example = REPO / "examples" / "plugins" / "herd_example_policy.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(example.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("herd_operator")
    }
    assert imported == {"herd_operator.policies.api"}
