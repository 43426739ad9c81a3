"""`herd-operator completion bash|zsh`: a shell completion script, written by shtab from the
parser itself, so every command and option completes as it is defined.

    source <(herd-operator completion bash)      # or save it in bash-completion's dir
    herd-operator completion zsh > "${fpath[1]}/_herd-operator"

A job's NAME completes with the jobs the operator knows (`herd-operator get -o name`,
with the --state-dir given on the line so far). Apart because it reads the whole parser
(`main.build_parser`, imported when the command runs), which no other group does.
"""

from __future__ import annotations

import argparse
import sys

from herd_operator.cli.arguments import Subcommands, add_command
from herd_operator.cli.views import EXIT_OK

SHELLS = ("bash", "zsh")
JOBS_FUNCTION = "_herd_operator_jobs"

# The words so far are searched for --state-dir (both spellings), so that names come from
# the state the command will read; errors (no state yet) complete nothing.
_BASH_JOBS = f"""
{JOBS_FUNCTION}() {{
  local state=() i
  for ((i = 1; i < ${{#COMP_WORDS[@]}}; i++)); do
    case "${{COMP_WORDS[i]}}" in
      --state-dir) state=(--state-dir "${{COMP_WORDS[i+1]}}") ;;
      --state-dir=*) state=("${{COMP_WORDS[i]}}") ;;
    esac
  done
  local names
  names=$(herd-operator "${{state[@]}}" get -o name 2>/dev/null | sed 's|^herdjob/||')
  compgen -W "$names" -- "$1"
}}
"""
_ZSH_JOBS = f"""
{JOBS_FUNCTION}() {{
  local -a state jobs
  local i
  for ((i = 2; i < ${{#words}}; i++)); do
    case "${{words[i]}}" in
      --state-dir) state=(--state-dir "${{words[i+1]}}") ;;
      --state-dir=*) state=("${{words[i]}}") ;;
    esac
  done
  jobs=(${{(f)"$(herd-operator "${{state[@]}}" get -o name 2>/dev/null)"}})
  compadd -- ${{jobs#herdjob/}}
}}
"""
JOB_NAME = {"bash": JOBS_FUNCTION, "zsh": JOBS_FUNCTION}
"""What a job-name argument's `complete` is (shtab's per-shell completion): see
`complete_job_names`."""


def complete_job_names(action: argparse.Action) -> argparse.Action:
    """Mark a positional that takes a job's name: it completes with the operator's jobs."""
    action.complete = JOB_NAME  # type: ignore[attr-defined]
    return action


def add_commands(commands: Subcommands) -> None:
    completion = add_command(
        commands,
        "completion",
        cmd_completion,
        help="print a shell completion script (bash or zsh)",
        description="Print a completion script for SHELL. bash: `source <(herd-operator "
        "completion bash)`, or save it as /etc/bash_completion.d/herd-operator; zsh: save "
        'it as _herd-operator in a directory of $fpath (e.g. "${fpath[1]}").',
    )
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")


def completion_script(shell: str) -> str:
    import shtab

    from herd_operator.cli.main import build_parser

    parser = build_parser()
    script = shtab.complete(parser, shell, preamble=_BASH_JOBS if shell == "bash" else _ZSH_JOBS)
    return script if script.endswith("\n") else script + "\n"


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(completion_script(args.shell))
    return EXIT_OK
