"""`multinode-resize`: a spec edit -> the first training step at the new size, across hosts.

Three hosts, each a network namespace with its own address (`devtools.cluster`, no Slurm):
h1 and h2 with 2 virtual GPUs and an sshd each, and h0, where the jobs are launched from
(a service node: every worker is started over ssh). A job (min 2, max 4) of the example
training script starts at 2 workers on h1, is grown to 4 (the new workers on h2) and
shrunk back to 2:

- ours: `herd-operator run --hosts h1:2,h2:2 --network-interface eth0` on h0; the
  trigger is the rename of the edited spec file (`policy.params.gpus`), so the figure
  holds everything the operator adds: noticing the edit, the decision, the grant;
- baseline: a bare `horovodrun` on h0 whose discovery script `cat`s a hosts file edited
  by hand (`h1:2` -> `h1:2 h2:2` -> `h1:2`); the trigger is that file's rename.

Both end at the first step that rank 0 (on h1) completes at the new world size. Each
run is a fresh job; ours and the baseline alternate which goes first.

Why h0 and not h1: stock horovodrun cannot start an elastic job whose first hosts are
all its own node when `--network-interface` names a real interface (it then looks for
127.0.0.1 on that interface), and it needs that interface from the start to grow onto
other nodes later. The operator's in-process driver does not have that limit; the bare
baseline does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from devtools.cluster import NamespaceCluster, cluster_unavailable, namespace_cluster
from herd_operator.bench.harness import (
    Context,
    Row,
    Skip,
    Stats,
    paired_ratio_figures,
    stop_session,
)
from herd_operator.bench.training import (
    REPO,
    StepLog,
    modified_at,
    resize_stalls,
    train_command,
    training_spec,
)
from herd_operator.layout import write_atomically
from herd_operator.runtime.engines.horovod import horovodrun_executable

JOB = "bench-multinode"
LAUNCH_HOST = "h0"
FIRST_HOST = "h1"
OTHER_HOST = "h2"
GPUS_PER_HOST = 2
INTERFACE = "eth0"
STOP_GUARD_S = 60.0
# The same for both modes. Not Gloo's 30 min default: a run that goes wrong ends in a minute;
# not less: on 2 loaded cores a new worker can take 20 s to join the rendezvous.
GLOO_TIMEOUT_S = "60"


def hosts_line(size: int) -> str:
    """The hosts file for `size` workers: h1's GPUs first, then h2's."""
    lines = [f"{FIRST_HOST}:{min(size, GPUS_PER_HOST)}"]
    if size > GPUS_PER_HOST:
        lines.append(f"{OTHER_HOST}:{size - GPUS_PER_HOST}")
    return "".join(f"{line}\n" for line in lines)


def job_environment(cluster: NamespaceCluster) -> dict[str, str]:
    """What both modes add to the environment: the cluster's `ssh` (its keys) and this
    Python's bin first on PATH, and the Gloo timeout."""
    path = os.pathsep.join([str(cluster.bin_dir), str(Path(sys.executable).parent)])
    return {
        "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": GLOO_TIMEOUT_S,
        "PYTHONUNBUFFERED": "1",
    }


def wait_until_gone(marker: str, what: str) -> None:
    """Wait until no process on any host has `marker` (the run's step log) on its command
    line: the next run must not share the CPUs or the GPUs with this one."""
    deadline = time.monotonic() + STOP_GUARD_S
    while any(
        marker in " ".join(process.info["cmdline"] or ())
        for process in psutil.process_iter(["cmdline"])
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: processes still running {STOP_GUARD_S:.0f} s after stop")
        time.sleep(0.2)


# ---- bare horovodrun ----


@dataclass
class BareRun:
    hosts_file: Path
    log: StepLog

    def resize(self, size: int) -> float:
        write_atomically(self.hosts_file, hosts_line(size))
        return modified_at(self.hosts_file)


@contextlib.contextmanager
def bare_run(cluster: NamespaceCluster, root: Path, label: str) -> Iterator[BareRun]:
    root.mkdir(parents=True)
    hosts_file = root / "hosts"
    write_atomically(hosts_file, hosts_line(2))
    script = root / "discover.sh"
    write_atomically(script, f"#!/bin/sh\nexec cat {hosts_file}\n", mode=0o755)
    log = StepLog(root / "steps.txt")
    argv = [
        horovodrun_executable(),
        "-np", "2", "--min-np", "2", "--max-np", str(2 * GPUS_PER_HOST),
        "--host-discovery-script", str(script),
        "--network-interface", INTERFACE,
        *train_command(log.path),
    ]  # fmt: skip
    process = cluster.spawn(
        LAUNCH_HOST, ["sh", "-c", 'cd "$1" && shift && exec "$@"', "cd", str(REPO), *argv],
        f"{label}.log", job_environment(cluster),
    )  # fmt: skip
    try:
        yield BareRun(hosts_file, log)
    finally:
        stop_session(process, 20.0)
        wait_until_gone(str(log.path), label)


# ---- under the operator ----


@dataclass
class OperatorRun:
    specs_dir: Path
    log: StepLog

    @property
    def spec_path(self) -> Path:
        return self.specs_dir / f"{JOB}.yaml"

    def resize(self, size: int) -> float:
        document = training_spec(JOB, self.log.path, 2, 2 * GPUS_PER_HOST, size)
        write_atomically(self.spec_path, yaml.safe_dump(document))
        return modified_at(self.spec_path)


@contextlib.contextmanager
def running_operator(cluster: NamespaceCluster, root: Path) -> Iterator[Path]:
    """`herd-operator run` on h0 over h1 and h2; yields its specs dir."""
    specs_dir = root / "jobs"
    specs_dir.mkdir(parents=True)
    argv = [
        sys.executable, "-m", "herd_operator.cli", "run",
        "--specs-dir", str(specs_dir), "--state-dir", str(root / "state"),
        "--hosts", f"{FIRST_HOST}:{GPUS_PER_HOST},{OTHER_HOST}:{GPUS_PER_HOST}",
        "--network-interface", INTERFACE,
        # The trigger is the spec edit: no resize freeze, a prompt resync.
        "--min-resize-interval", "0", "--resync-seconds", "1", "--relist-seconds", "1",
        "--grace-seconds", "5", "--metrics-port", "0",
    ]  # fmt: skip
    process = cluster.spawn(LAUNCH_HOST, argv, "operator.log", job_environment(cluster))
    try:
        yield specs_dir
    finally:
        stop_session(process)


@contextlib.contextmanager
def operator_run(specs_dir: Path, root: Path, label: str) -> Iterator[OperatorRun]:
    root.mkdir(parents=True)
    run = OperatorRun(specs_dir, StepLog(root / "steps.txt"))
    run.resize(2)
    try:
        yield run
    finally:
        run.spec_path.unlink(missing_ok=True)
        wait_until_gone(str(run.log.path), label)


# ---- the benchmark ----


def run_multinode_resize(ctx: Context) -> list[Row]:
    unavailable = cluster_unavailable(slurm=False)
    if unavailable:
        raise Skip(f"no namespace hosts: {unavailable}")
    ours_up: list[float] = []
    ours_down: list[float] = []
    bare_up: list[float] = []
    bare_down: list[float] = []
    with (
        namespace_cluster(
            ctx.scratch / "cluster", compute=2, gpus=GPUS_PER_HOST, slurm=False
        ) as cluster,
        running_operator(cluster, ctx.scratch / "operator") as specs_dir,
    ):
        for index in range(ctx.repeat):
            for mode in ("bare", "operator") if index % 2 == 0 else ("operator", "bare"):
                ctx.progress(f"multinode-resize: run {index + 1}, {mode}")
                label = f"{mode}-{index}"
                root = ctx.scratch / label
                job: BareRun | OperatorRun
                with (
                    bare_run(cluster, root, label)
                    if mode == "bare"
                    else operator_run(specs_dir, root, label)
                ) as job:
                    up, down = resize_stalls(job.resize, job.log, 1)
                (bare_up if mode == "bare" else ours_up).extend(up)
                (bare_down if mode == "bare" else ours_down).extend(down)
                ctx.progress(f"multinode-resize: {mode} 2->4 {up[0]:.1f} s, 4->2 {down[0]:.1f} s")
    return [
        Row(
            name=f"multinode-resize {label}",
            what=f"edit -> first training step at the new world size, {what}",
            unit="s",
            better="lower",
            baseline_label="bare horovodrun, hosts file edited by hand",
            baseline=Stats.of(bare),
            ours=Stats.of(ours),
            extra=paired_ratio_figures(ours, bare),
        )
        for label, what, ours, bare in (
            ("2->4", "growing from h1 onto h2 (ssh)", ours_up, bare_up),
            ("4->2", "shrinking back to h1", ours_down, bare_down),
        )
    ]
