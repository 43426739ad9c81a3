"""`herd-operator apply`, `delete`, `suspend` and `resume`: the commands that change what the
operator is asked to run, by writing its spec directory (the only API it has, as a
Kubernetes object store is kubectl's).

Apart from the reading commands: these write, and only spec files, whole (see
`spec_files`); the operator acts on them at its next relist, as on any edit. Each
validates before it writes: a spec the operator would refuse is never written.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.cli.arguments import Subcommands, add_command, positive_float, state_dir_option
from herd_operator.cli.selectors import Selector, SelectorError, parse_selector
from herd_operator.cli.spec_commands import checked_sources, spec_warnings
from herd_operator.cli.spec_files import (
    Declared,
    SpecsDirError,
    not_found,
    same_job,
    specs_dir,
    specs_dir_option,
    with_suspend,
    write_spec_file,
)
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK
from herd_operator.layout import StateLayout
from herd_operator.specs import HerdJob

DELETE_WAIT_POLL_SECONDS = 0.5
DEFAULT_DELETE_TIMEOUT_SECONDS = 300.0


def add_commands(commands: Subcommands) -> None:
    apply = add_command(
        commands,
        "apply",
        cmd_apply,
        help="validate job specs and write them into the spec directory",
        description="Validate every job of the sources first (as `validate` does), then "
        "write each into the spec directory, atomically: NAME.yaml for a new job, the file "
        "that declares it for a known one. A problem in any of them writes none. Prints "
        "`herdjob/NAME created|configured|unchanged`. Exit 0, or 1 on a problem.",
    )
    apply.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE|DIR|-",
        help="a spec file (several YAML documents, or a List saved from `get -o yaml`, are "
        "several jobs), a directory of them, or - for standard input; repeatable",
    )
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and say what each job would be (created, configured, unchanged); "
        "write nothing",
    )
    specs_dir_option(apply)
    state_dir_option(apply)  # unused: taken as every verb takes it, so scripts can pass it

    delete = add_command(
        commands,
        "delete",
        cmd_delete,
        help="remove jobs' spec files (the operator stops and forgets them)",
        description="Remove the spec file of each job named, selected (-l) or declared in "
        "the -f sources; the operator "
        "stops the job's processes and frees its GPUs, as for any deleted file. Exit 1 when "
        "a name is declared by no spec (the others are deleted), or on --wait's timeout.",
    )
    delete.add_argument("names", nargs="*", metavar="NAME")
    delete.add_argument(
        "-l", "--selector", type=_selector, help="the jobs whose labels match (as `get -l`)"
    )
    delete.add_argument(
        "-f",
        "--filename",
        action="append",
        metavar="FILE|DIR|-",
        help="the jobs these specs declare (as `apply -f` reads them); repeatable",
    )
    delete.add_argument(
        "--wait",
        action="store_true",
        help="then wait until the operator has removed each job from its state",
    )
    delete.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_DELETE_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"with --wait: give up after SECONDS (default: {DEFAULT_DELETE_TIMEOUT_SECONDS:.0f})",
    )
    specs_dir_option(delete)
    state_dir_option(delete)

    for verb, value, what in (
        ("suspend", True, "stop a job's workers and free its GPUs, keeping the job"),
        ("resume", False, "let a suspended job be admitted and launched again"),
    ):
        parser = add_command(
            commands,
            verb,
            cmd_suspend if value else cmd_resume,
            help=f"{what} (sets spec.suspend: {str(value).lower()})",
            description=f"{what[0].upper()}{what[1:]}: sets `spec.suspend: "
            f"{str(value).lower()}` in the job's spec file (the rest of the file stays as "
            "written), which the operator acts on. A resumed job starts its command again; "
            "a script that keeps a checkpoint goes on from it. Exit 1 when a name is "
            "declared by no spec.",
        )
        parser.add_argument("names", nargs="+", metavar="NAME")
        specs_dir_option(parser)
        state_dir_option(parser)


def _selector(text: str) -> Selector:
    try:
        return parse_selector(text)
    except SelectorError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_FAILURE


@dataclass(frozen=True)
class _Write:
    """One job of an apply: where it goes and what the apply does to it."""

    name: str
    path: Path
    text: str
    action: str
    """created, configured or unchanged (kubectl's words)."""


def plan_apply(
    jobs: Sequence[tuple[HerdJob, str]], declared: Declared, directory: Path
) -> tuple[list[_Write], list[str]]:
    """Where each (job, its text) goes and whether it changes anything, or the problems
    that keep the apply from writing: a name declared by several files of the directory,
    a new job whose file name is taken by a file that declares another job."""
    writes: list[_Write] = []
    problems: list[str] = []
    for job, text in jobs:
        try:
            existing = declared.one_file(job.name)
        except SpecsDirError as err:
            problems.append(f"{err}; keep one of them")
            continue
        if existing is None:
            path = directory / f"{job.name}.yaml"
            if path in declared.paths or path.exists():
                problems.append(
                    f"{path} exists and does not declare job {job.name!r}; rename it or"
                    " give the job another name"
                )
                continue
            writes.append(_Write(job.name, path, text, "created"))
            continue
        if existing.job is not None and existing.job.spec.suspend:
            job, text = _kept_suspended(job, text, str(existing.path))
        if existing.job is not None and same_job(existing.job, job):
            writes.append(_Write(job.name, existing.path, text, "unchanged"))
        else:
            writes.append(_Write(job.name, existing.path, text, "configured"))
    return writes, problems


def _kept_suspended(job: HerdJob, text: str, file: str) -> tuple[HerdJob, str]:
    """A job suspended now stays so when the applied spec does not say `suspend` (as
    kubectl's apply keeps a field it does not manage): applying an edit is no resume."""
    if "suspend" in job.spec.model_fields_set:
        return job, text
    kept = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    return kept, with_suspend(text, job, True, file)


def cmd_apply(args: argparse.Namespace) -> int:
    try:
        directory = specs_dir(args.specs_dir)
    except SpecsDirError as err:
        return _error(str(err))
    documents, problems = checked_sources(args.filename, sys.stdin)
    for warning in spec_warnings([document.spec_file for document in documents]):
        print(warning, file=sys.stderr)
    if not problems:
        jobs = [(doc.spec_file.job, doc.text) for doc in documents if doc.spec_file.job]
        try:
            writes, problems = plan_apply(jobs, Declared.scan(directory), directory)
        except OSError as err:
            return _error(f"cannot read the spec directory {directory}: {err}")
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return _error(f"nothing applied: {len(problems)} problem(s); no spec file was written")
    if args.dry_run:
        for write in writes:
            print(f"herdjob/{write.name} {write.action} (dry run)", flush=True)
        return EXIT_OK
    for index, write in enumerate(writes):
        if write.action != "unchanged":
            try:
                write_spec_file(write.path, write.text)
            except OSError as err:
                left = ", ".join(w.name for w in writes[index:] if w.action != "unchanged")
                return _error(f"cannot write {write.path}: {err}; not applied: {left}")
        print(f"herdjob/{write.name} {write.action}", flush=True)
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    given = [bool(args.names), args.selector is not None, bool(args.filename)]
    if sum(given) != 1:
        return _error("name the jobs to delete, or give -l or -f; one of them")
    try:
        declared = Declared.scan(specs_dir(args.specs_dir))
        names = _delete_targets(args, declared)
        found = {name: declared.one_file(name) for name in names}
    except SpecsDirError as err:
        return _error(str(err))
    if not names:
        print("No resources found", file=sys.stderr)
        return EXIT_OK
    code = EXIT_OK
    deleted = []
    for name, spec_file in found.items():
        if spec_file is None:
            print(not_found(name), file=sys.stderr)
            code = EXIT_FAILURE
            continue
        try:
            spec_file.path.unlink()
        except FileNotFoundError:  # removed since the scan: deleted all the same
            pass
        except OSError as err:
            print(f"error: cannot delete {spec_file.path}: {err}", file=sys.stderr)
            code = EXIT_FAILURE
            continue
        deleted.append(name)
        print(f'herdjob "{name}" deleted', flush=True)
    if args.wait and deleted and not _wait_until_gone(args.state_dir, deleted, args.timeout):
        return _error(f"timed out after {args.timeout:g}s waiting for the operator to remove them")
    return code


def _delete_targets(args: argparse.Namespace, declared: Declared) -> list[str]:
    """The names `delete` was given: as arguments, the jobs whose labels match -l, or the
    jobs the -f sources declare (valid or not: a name is enough to delete by)."""
    if args.selector is not None:
        return sorted(
            name
            for name, files in declared.files.items()
            if len(files) == 1
            and files[0].job is not None
            and args.selector.matches(files[0].job.metadata.labels)
        )
    if args.filename:
        from herd_operator.specs.sources import read_sources

        documents = read_sources(args.filename, sys.stdin)
        return list(dict.fromkeys(d.spec_file.name for d in documents if d.spec_file.name))
    return list(dict.fromkeys(args.names))


def _wait_until_gone(state_dir: Path, names: Sequence[str], timeout: float) -> bool:
    """Whether the operator removed every job of `names` from its state within `timeout`
    (its processes stopped and its GPUs freed first). No state: nothing to wait for."""
    from herd_operator.cli.wait import poll
    from herd_operator.runtime.store import Store

    database = StateLayout(state_dir).database
    if not database.exists():
        return True
    with Store.open_readonly(database) as store:

        def gone() -> bool | None:
            return True if all(store.get_job(name) is None for name in names) else None

        return bool(poll(gone, timeout, time.monotonic, time.sleep, DELETE_WAIT_POLL_SECONDS))


def cmd_suspend(args: argparse.Namespace) -> int:
    return _set_suspend(args, True)


def cmd_resume(args: argparse.Namespace) -> int:
    return _set_suspend(args, False)


def _set_suspend(args: argparse.Namespace, suspend: bool) -> int:
    try:
        directory = specs_dir(args.specs_dir)
        declared = Declared.scan(directory)
        found = {name: declared.one_file(name) for name in dict.fromkeys(args.names)}
    except SpecsDirError as err:
        return _error(str(err))
    code = EXIT_OK
    ended = _finished(args.state_dir, list(found)) if suspend else {}
    for name, spec_file in found.items():
        if spec_file is None:
            print(not_found(name), file=sys.stderr)
            code = EXIT_FAILURE
        elif name in ended:
            code = _error(f"herdjob/{name} {ended[name]}: a finished job is not suspended")
        elif spec_file.job is None:
            for error in spec_file.errors:
                print(error, file=sys.stderr)
            code = _error(f"{spec_file.path} is invalid: fix it first, then suspend or resume")
        elif spec_file.job.spec.suspend == suspend:
            print(f"herdjob/{name} unchanged", flush=True)
        else:
            try:
                text = spec_file.path.read_text(encoding="utf-8-sig")
                edited = with_suspend(text, spec_file.job, suspend, str(spec_file.path))
                write_spec_file(spec_file.path, edited)
            except OSError as err:
                code = _error(f"cannot rewrite {spec_file.path}: {err}")
                continue
            print(f"herdjob/{name} {'suspended' if suspend else 'resumed'}", flush=True)
    return code


def _finished(state_dir: Path, names: Sequence[str]) -> dict[str, str]:
    """The jobs of `names` that succeeded or failed for their current spec, by what they
    did, as the operator's state says (none without one). Suspending one would change
    nothing, and its resume (a new generation) would run it again."""
    from herd_operator.runtime.store import Store
    from herd_operator.specs import ConditionType, get_condition

    database = StateLayout(state_dir).database
    if not database.exists():
        return {}
    ended = {}
    with Store.open_readonly(database) as store:
        for name in names:
            record = store.get_job(name)
            if record is None:
                continue
            for kind in (ConditionType.Succeeded, ConditionType.Failed):
                condition = get_condition(record.status.conditions, kind)
                if (
                    condition is not None
                    and condition.status == "True"
                    and condition.observed_generation == record.generation
                ):
                    ended[name] = str(kind)
    return ended
