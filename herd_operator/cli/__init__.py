"""The `herd-operator` command line: commands (`main`), views, the report and the demo."""

from __future__ import annotations

from herd_operator.cli.main import main

__all__ = ["main"]
