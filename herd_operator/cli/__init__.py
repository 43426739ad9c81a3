"""The `herd-operator` command line: `main` assembles the command groups (a module each),
and the views, the report and the demo they share."""

from __future__ import annotations

from herd_operator.cli.main import main

__all__ = ["main"]
