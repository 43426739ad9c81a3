"""`herd-operator validate` and `schema`: job specs checked as the operator would read
them (and `apply` writes them: `checked_sources` is both commands' reading), and the JSON
Schema of the spec.

Apart because they need no operator and no state directory, only the declarative API
and the registries of policies and engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

from herd_operator.cli.arguments import Subcommands, add_command
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK

if TYPE_CHECKING:
    from herd_operator.specs.loading import SpecFile
    from herd_operator.specs.sources import SourceDocument


def add_commands(commands: Subcommands) -> None:
    validate = add_command(
        commands,
        "validate",
        cmd_validate,
        help="check job spec files; exit 1 on problems",
        description="Check job specs as the operator and `apply` would take them: files, "
        "directories (their *.yaml and *.yml files), - for standard input; a file of "
        "several YAML documents, or a List saved from `get -o yaml` (its status ignored), "
        "is several jobs. One line per problem, naming the file and the field; exit 1 on any.",
    )
    validate.add_argument("files", nargs="+", metavar="FILE|DIR|-")

    add_command(commands, "schema", cmd_schema, help="print the JSON Schema of the HerdJob spec")


def checked_sources(
    sources: Sequence[str], stdin: IO[str]
) -> tuple[list[SourceDocument], list[str]]:
    """Every job of `sources`, checked as the operator checks a spec file (its policy and
    engine too), and the problems, names declared more than once among them included."""
    from herd_operator.runtime.specdir import with_known_references
    from herd_operator.specs import index_specs
    from herd_operator.specs.sources import read_sources

    documents = [
        dataclasses.replace(document, spec_file=with_known_references(document.spec_file))
        for document in read_sources(sources, stdin)
    ]
    files = [document.spec_file for document in documents]
    problems = [str(error) for spec_file in files for error in spec_file.errors]
    index = index_specs([f for f in files if f.valid])
    for errors in index.invalid.values():
        problems += [str(error) for error in errors]
    return documents, problems


def spec_warnings(files: Sequence[SpecFile]) -> list[str]:
    """What is allowed but odd in valid spec files (a policy's GPU count outside [min, max]),
    one line each naming the file and the field; the operator says them as Warning events."""
    from herd_operator.policies.registry import params_warnings

    return [
        f"warning: {spec_file.path}: {warning}"
        for spec_file in files
        if spec_file.job is not None
        for warning in params_warnings(spec_file.job.spec)
    ]


def cmd_validate(args: argparse.Namespace) -> int:
    documents, problems = checked_sources(args.files, sys.stdin)
    for problem in problems:
        print(problem, file=sys.stderr)
    for warning in spec_warnings([document.spec_file for document in documents]):
        print(warning, file=sys.stderr)
    if problems:
        return EXIT_FAILURE
    for document in documents:
        print(f"{document.spec_file.path}: ok ({document.spec_file.name})")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from herd_operator.policies.registry import builtin_params_models, builtin_summaries
    from herd_operator.runtime.engines import ENGINES, OPTION_MODELS
    from herd_operator.specs import json_schema

    schema = json_schema(
        builtin_params_models(),
        engine_options=OPTION_MODELS,
        policy_summaries=builtin_summaries(),
        engine_kinds=list(ENGINES),
    )
    print(json.dumps(schema, indent=2))
    return EXIT_OK
