"""`herd-operator validate` and `schema`: job spec files checked as the operator would read
them, and the JSON Schema of the spec.

Apart because they need no operator and no state directory, only the declarative API
and the registries of policies and engines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from herd_operator.cli.arguments import Subcommands, add_command
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK

if TYPE_CHECKING:
    from herd_operator.specs import SpecFile


def add_commands(commands: Subcommands) -> None:
    validate = add_command(
        commands, "validate", cmd_validate, help="check job spec files; exit 1 on problems"
    )
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")

    add_command(commands, "schema", cmd_schema, help="print the JSON Schema of the HerdJob spec")


def validate_files(paths: Sequence[Path]) -> tuple[list[SpecFile], list[str]]:
    """Load each file, check its policy and engine, and check names across the files."""
    from herd_operator.runtime.specdir import with_known_references
    from herd_operator.specs import index_specs, load_spec_file

    files = [with_known_references(load_spec_file(path)) for path in paths]
    problems = [str(error) for spec_file in files for error in spec_file.errors]
    index = index_specs([f for f in files if f.valid])
    for errors in index.invalid.values():
        problems += [str(error) for error in errors]
    return files, problems


def cmd_validate(args: argparse.Namespace) -> int:
    files, problems = validate_files(args.files)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return EXIT_FAILURE
    for spec_file in files:
        print(f"{spec_file.path}: ok ({spec_file.name})")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from herd_operator.policies.registry import builtin_params_models
    from herd_operator.runtime.engines import OPTION_MODELS
    from herd_operator.specs import json_schema

    print(json.dumps(json_schema(builtin_params_models(), OPTION_MODELS), indent=2))
    return EXIT_OK
