"""`herd-operator exporter` and `agent-key`: what runs on each node of the pool, and the key
it proves itself with.

Apart from `run`: these run on the other nodes, and their keys are handled nowhere else
in the CLI.
"""

from __future__ import annotations

import argparse
import sys

from herd_operator.cli.arguments import (
    Subcommands,
    add_command,
    gpu_metrics_options,
    parse_bytes,
    port,
    positive_int,
    state_dir_option,
)
from herd_operator.cli.foreground import configure_logging, log_options, stop_on_signals
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from herd_operator.layout import StateLayout

KEY_LINE_MAX_CHARS = 256
"""What `exporter --key-stdin` reads at most: a key is 64 hex characters and a newline."""


def add_commands(commands: Subcommands) -> None:
    agent_key = add_command(
        commands,
        "agent-key",
        cmd_agent_key,
        help="print one host's agent key, to pipe into `exporter --key-stdin` on that host",
    )
    state_dir_option(agent_key)
    agent_key.add_argument("--host", required=True, help="the node's name as the pool spells it")

    exporter = add_command(
        commands,
        "exporter",
        cmd_exporter,
        help="serve this node's GPU metrics (one per node, e.g. srun --overlap)",
    )
    state_dir_option(exporter)
    exporter.add_argument("--port", type=port, default=9411, help="default: 9411 (0: any)")
    exporter.add_argument(
        "--listen",
        help="address to serve on (default: the one --host resolves to here, where the operator "
        "and Prometheus scrape it: loopback for a pool on this node alone, else this node's "
        "address, not every interface; docs/observability.md; 0.0.0.0: every interface)",
    )
    exporter.add_argument(
        "--host", help="this node's name as the pool spells it (default: the host name)"
    )
    exporter.add_argument(
        "--virtual-gpus",
        type=positive_int,
        help="virtual GPUs where NVML finds none (default: as many as the operator's pool "
        "has on this host, else Slurm's SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE, else 4); "
        "given, also on a host whose NVIDIA devices NVML cannot read",
    )
    exporter.add_argument("--virtual-gpu-memory", type=parse_bytes, default=2 << 30)
    exporter.add_argument(
        "--key-stdin",
        action="store_true",
        help="read this host's agent key from the first line of stdin (from "
        "`herd-operator agent-key`) instead of the state dir's secrets/agent-HOST.token",
    )
    gpu_metrics_options(exporter)
    log_options(exporter)


def cmd_agent_key(args: argparse.Namespace) -> int:
    from herd_operator.auth import TokenFileError, agent_key, read_token_file

    try:
        host = _checked_host(args.host)
        master = read_token_file(StateLayout(args.state_dir).token_file)
    except (ValueError, TokenFileError) as err:
        print(f"herd-operator agent-key: {err}", file=sys.stderr)
        return EXIT_FAILURE
    if sys.stdout.isatty():
        # A key on a screen ends up in scrollback and terminal logs.
        print(
            "herd-operator agent-key: stdout is a terminal; pipe the key into "
            "`herd-operator exporter --key-stdin` (e.g. through srun) instead",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.write(agent_key(master, host).hex() + "\n")
    return EXIT_OK


def _checked_host(text: str) -> str:
    """``text`` if it is a host name an agent may speak for; ValueError naming --host if not."""
    from herd_operator.auth import is_host

    if not is_host(text):
        raise ValueError(
            f"--host {text!r}: not a host name (letters, digits, '-', '_', '.', ':', '%'; "
            "at most 253 characters)"
        )
    return text


def cmd_exporter(args: argparse.Namespace) -> int:
    from herd_operator.agent.exporter import run_exporter
    from herd_operator.auth import TokenFileError, parse_key

    configure_logging(args.log_level, args.log_format)
    key = None
    if args.key_stdin:
        try:
            key = parse_key(sys.stdin.readline(KEY_LINE_MAX_CHARS), "--key-stdin: stdin")
        except TokenFileError as err:
            print(f"herd-operator exporter: {err}", file=sys.stderr)
            return EXIT_USAGE
    stop = stop_on_signals()
    try:
        return run_exporter(
            args.state_dir,
            args.host,
            args.listen,
            args.port,
            args.virtual_gpus,
            args.virtual_gpu_memory,
            stop,
            per_process=args.process_metrics,
            dcgm_job_mapping_dir=args.dcgm_job_mapping_dir,
            key=key,
        )
    except OSError as err:
        print(
            f"herd-operator exporter: cannot serve on {args.listen or 'its address'}:{args.port}: "
            f"{err}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
