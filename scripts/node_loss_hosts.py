"""A node lost under a job, with no agents: `run --hosts h1:2,h2:2`, the operator on h1.

Two network-namespace hosts with sshd (`devtools.cluster`, no Slurm), needs
root. `wide` (min 2, max 4) trains on both hosts; `pair` (min 2, priority -1) waits for
GPUs. h2's link goes down for `--watch` seconds, then comes back. Prints, as JSON: the
GPUs of h2 granted after its link went down (each a job that did not hold it before),
whether `wide` or `pair` ended Failed, `wide`'s longest pause between training steps and
its steps after the loss, when h2 was lost (`NodeLost`) and when it was back.

    sudo .venv/bin/python scripts/node_loss_hosts.py [--watch 150] [--keep DIR]

issue 25 (item 2) saw `wide` go on at 2 workers, then fail: h2's GPUs were granted again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # devtools and the tests' harness, neither installed

from devtools.bench.multinode import job_environment  # noqa: E402
from devtools.cluster import cluster_unavailable, namespace_cluster  # noqa: E402
from herd_operator.bench.harness import stop_session  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    HERD,
    OperatorHarness,
    digits_command,
    new_grants_on,
    soon,
    spec_document,
    steps,
)


def measure(root: Path, watch_seconds: float) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with namespace_cluster(root / "cluster", compute=2, gpus=2, slurm=False) as cluster:
        herd = OperatorHarness(root / "herd")
        herd.specs_dir.mkdir(parents=True)
        operator = cluster.spawn(
            "h1",
            [
                HERD, "run", "--specs-dir", str(herd.specs_dir),
                "--state-dir", str(herd.layout.root), "--hosts", "h1:2,h2:2",
                "--network-interface", "eth0", "--resync-seconds", "0.5",
                "--relist-seconds", "1", "--grace-seconds", "5", "--min-resize-interval", "1",
                "--metrics-port", "0",
            ],
            "operator.log",
            job_environment(cluster),
        )  # fmt: skip
        log = cluster.root / "log" / "operator.log"
        step_log = root / "wide.steps"

        def failed(name: str) -> bool:
            return (herd.condition(name, "Failed") or {}).get("status") == "True"

        def training_at(gpus: int) -> bool:
            job, reports = herd.job("wide"), herd.reports("wide")
            return bool(
                job and job["gpus"]["allocated"] == gpus and reports
                and reports[-1].world_size == gpus
            )  # fmt: skip

        try:
            herd.wait_for(herd.layout.endpoint_file.exists, "the operator's endpoint file", 60)
            command = digits_command(
                10_000, "--step-delay", "0.05", "--batch-size", "64", "--step-log", str(step_log)
            )
            herd.write_spec(spec_document("wide", 2, 4, command))
            herd.wait_for(lambda: training_at(4), "wide training at 4 on h1 and h2", 240)
            pair = digits_command(10_000, "--step-delay", "0.05")
            herd.write_spec(spec_document("pair", 2, 2, pair, priority=-1))
            herd.wait_for(lambda: (herd.job("pair") or {}).get("gpus"), "pair recorded", 60)
            offset = len(log.read_text())
            down = time.time()
            cluster.link("h2", up=False)
            soon(lambda: failed("wide"), watch_seconds)
            figures["grants_to_h2"] = new_grants_on(log.read_text(), offset, "h2")
            figures["failed"] = [name for name in ("wide", "pair") if failed(name)]
            rows = steps(step_log)
            gaps = [b - a for (a, _), (b, _) in itertools.pairwise(rows) if b > down]
            figures["wide_longest_pause_s"] = round(max(gaps), 1) if gaps else None
            figures["wide_steps_after_the_loss"] = sum(1 for at, _ in rows if at > down)
            figures["wide_last_world_size"] = rows[-1][1] if rows else None
            lost = [e for e in herd.events() if e.reason == "NodeLost" and "node h2 " in e.message]
            figures["node_lost_after_s"] = round(lost[0].time - down, 1) if lost else None
            cluster.link("h2", up=True)
            up = time.time()
            back = soon(
                lambda: [e for e in herd.events() if e.reason == "NodeBack" and e.time > up], 30
            )
            figures["node_back_after_link_up_s"] = round(back[0].time - up, 1) if back else None
        finally:
            stop_session(operator)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--watch", type=float, default=150.0, help="seconds with h2 down")
    parser.add_argument("--keep", type=Path, help="work here and keep it (logs, state)")
    args = parser.parse_args()
    unavailable = cluster_unavailable(slurm=False)
    if unavailable:
        print(f"node_loss_hosts: no namespace hosts: {unavailable}", file=sys.stderr)
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True)
        figures = measure(args.keep, args.watch)
    else:
        with tempfile.TemporaryDirectory(prefix="herd-node-loss-") as scratch:
            figures = measure(Path(scratch), args.watch)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
