"""Issue 27's spec-directory cases against a real `herd-operator run`, for reliability.md.

    python scripts/specdir_probe.py HERD_OPERATOR [--seconds 25] [--only loop|swap|yaml ...]

HERD_OPERATOR is the `herd-operator` executable of the tree to probe (this one's, or an
older tree's, to measure "before"). Each case starts an operator on a fresh state and spec
directory under a temporary directory (a pool of 2 virtual GPUs on this host, metrics on any
free port), does what the case says, and prints one line of what it saw; the operator is
stopped (SIGTERM, then SIGKILL) and its jobs with it, whatever happens.

- loop-at-start: a link to itself in the spec directory when the operator starts, and a
  spec: does the operator run, is the job created;
- loop: the same link made once the operator relists, then a new spec whose name sorts
  before it: was the new job created, how many relists failed (its /metrics), how many
  bytes of log in SECONDS;
- swap-KIND over a running job's file (fifo, link-out, other-user: chown needs root, else
  it is left out), 8 s later: is the job still there and running, how many launches it
  started, its SpecValid;
- yaml-error: a file whose YAML error stops its name being read: does `events` show it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

KEEPER = (
    "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {name: keeper}\n"
    "spec:\n  command: [python, -c, 'import time; time.sleep(900)']\n"
    "  gpus: {min: 1, max: 1}\n"
)
NEW = KEEPER.replace("name: keeper", "name: a-new")
FOREIGN = KEEPER.replace("name: keeper", "name: foreign")


@dataclass
class Operator:
    executable: str
    root: Path
    process: subprocess.Popen[bytes]

    @property
    def specs(self) -> Path:
        return self.root / "jobs"

    @property
    def log(self) -> Path:
        return self.root / "operator.log"

    def cli(self, *argv: str) -> str:
        result = subprocess.run(
            [self.executable, *argv, "--state-dir", str(self.root / "state")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return result.stdout

    def relist_errors(self) -> float | None:
        """herd_loop_errors_total of the relist loop, from the operator's /metrics."""
        try:
            endpoint = json.loads((self.root / "state" / "allocator.json").read_text())
            with urllib.request.urlopen(f"http://{endpoint['metrics']}/metrics", timeout=10) as got:
                text = got.read().decode()
        except (OSError, ValueError, KeyError):
            return None
        for line in text.splitlines():
            if line.startswith('herd_loop_errors_total{loop="spec-relist"}'):
                return float(line.split()[-1])
        return None

    def job(self, name: str) -> dict[str, object] | None:
        text = self.cli("get", name, "-o", "json")
        return json.loads(text) if text.strip() else None


@contextlib.contextmanager
def operator(
    executable: str, prepare: Callable[[Path], object] = lambda jobs: None
) -> Iterator[Operator]:
    with tempfile.TemporaryDirectory(prefix="specdir-probe-") as directory:
        root = Path(directory)
        (root / "jobs").mkdir()
        prepare(root / "jobs")
        with (root / "operator.log").open("wb") as log:
            process = subprocess.Popen(
                [
                    executable, "run", "--state-dir", str(root / "state"),
                    "--specs-dir", str(root / "jobs"), "--hosts", "localhost:2",
                    "--virtual-gpus", "2", "--metrics-port", "0", "--relist-seconds", "1",
                    "--resync-seconds", "0.5", "--grace-seconds", "3",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        running = Operator(executable, root, process)
        try:
            wait_for(lambda: (root / "state").exists(), 60)
            yield running
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def wait_for(probe: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.2)
    return False


def put(path: Path, make: Callable[[Path], None]) -> None:
    """`make` an entry under a hidden name, then rename it over `path` (as `mv -T`)."""
    staged = path.with_name(f".{path.name}.staged")
    make(staged)
    os.replace(staged, path)


def condition(job: dict[str, object] | None, kind: str) -> dict[str, str] | None:
    if job is None:
        return None
    status = job.get("status")
    conditions = status.get("conditions", []) if isinstance(status, dict) else []
    return next((c for c in conditions if c.get("type") == kind), None)


def is_running(job: dict[str, object] | None) -> bool:
    running = condition(job, "Running")
    return running is not None and running["status"] == "True"


def loop_case(executable: str, seconds: float) -> str:
    with operator(executable) as herd:
        # Made once the operator relists: its first relist (at start) is another case.
        (herd.specs / "z-first.yaml").write_text(FOREIGN)
        if not wait_for(lambda: herd.job("foreign") is not None, 90):
            return "loop: the operator did not take its first job"
        (herd.specs / "self.yaml").symlink_to("self.yaml")
        time.sleep(2)
        before = herd.log.stat().st_size
        errors_before = herd.relist_errors()
        (herd.specs / "a-new.yaml").write_text(NEW)
        time.sleep(seconds)
        log_bytes = herd.log.stat().st_size - before
        errors = herd.relist_errors()
        relists_failed = (
            "?" if errors is None or errors_before is None else f"{errors - errors_before:.0f}"
        )
        text = herd.log.read_text(errors="replace")
        failed = text.count("Symlink loop")
        created = herd.job("a-new") is not None
        skipped = text.count("skipping self.yaml")
    return (
        f"loop: new job created {created}; relists failed in {seconds:g} s: {relists_failed};"
        f" 'Symlink loop' in the log {failed} times; 'skipping self.yaml' {skipped} times;"
        f" {log_bytes:,} bytes of log in {seconds:g} s"
    )


def loop_at_start_case(executable: str) -> str:
    def loop(jobs: Path) -> None:
        (jobs / "self.yaml").symlink_to("self.yaml")
        (jobs / "a-new.yaml").write_text(NEW)

    with operator(executable, loop) as herd:
        created = wait_for(lambda: herd.job("a-new") is not None, 30)
        alive = herd.process.poll() is None
        traceback = "Traceback" in herd.log.read_text(errors="replace")
    return f"loop-at-start: operator running {alive}; job created {created}; traceback {traceback}"


def swap_case(executable: str, kind: str, make: Callable[[Path, Path], None]) -> str:
    with operator(executable) as herd:
        keeper = herd.specs / "keeper.yaml"
        keeper.write_text(KEEPER)
        if not wait_for(lambda: is_running(herd.job("keeper")), 90):
            return f"swap-{kind}: the job did not start"
        put(keeper, lambda staged: make(staged, herd.root))
        time.sleep(8)
        job = herd.job("keeper")
        running = condition(job, "Running")
        valid = condition(job, "SpecValid")
        events = herd.cli("events", "keeper")
        starts = sum(" Started " in line for line in events.splitlines())
    state = (
        "deleted"
        if job is None
        else f"Running={running and running['status']}, launches started {starts},"
        f" SpecValid={valid and valid['status']} ({valid and valid['message'][:90]})"
    )
    deleted = "spec deleted" in events
    return f"swap-{kind}: job {state}; 'spec deleted' event {deleted}"


def yaml_error_case(executable: str) -> str:
    with operator(executable) as herd:
        (herd.specs / "broken.yaml").write_text("metadata: {name: [unclosed\n")
        seen = wait_for(lambda: "broken.yaml" in herd.cli("events"), 15)
        in_log = "broken.yaml" in herd.log.read_text(errors="replace")
    return f"yaml-error: in `events` {seen}; in the log {in_log}"


def fifo(staged: Path, root: Path) -> None:
    os.mkfifo(staged)


def link_out(staged: Path, root: Path) -> None:
    (root / "elsewhere.yaml").write_text(FOREIGN)
    staged.symlink_to(root / "elsewhere.yaml")


def other_user(staged: Path, root: Path) -> None:
    staged.write_text(FOREIGN)
    os.chown(staged, 65534, 65534)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("executable")
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument(
        "--only", action="append", choices=["loop", "swap", "yaml"], help="these cases only"
    )
    args = parser.parse_args()
    only = set(args.only or ["loop", "swap", "yaml"])
    cases: list[tuple[str, Callable[[Path, Path], None]]] = [("fifo", fifo), ("link-out", link_out)]
    if os.geteuid() == 0:
        cases.append(("other-user", other_user))
    if "loop" in only:
        print(loop_at_start_case(args.executable), flush=True)
        print(loop_case(args.executable, args.seconds), flush=True)
    for kind, make in cases if "swap" in only else []:
        print(swap_case(args.executable, kind, make), flush=True)
    if "yaml" in only:
        print(yaml_error_case(args.executable), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
