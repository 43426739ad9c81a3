"""`herd-operator demo`: the example jobs, end to end, on this machine.

It runs a real operator in-process on localhost with virtual GPUs, drops the
example specs into its watched directory one after the other, narrates what
happens (admission, training, a resize to make room for a gang job, growth
back, completion) and ends with a summary table.
"""

from __future__ import annotations

import importlib.resources
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from herd_operator.cli.views import dash, epochs_completed, format_table, job_object
from herd_operator.layout import StateLayout, write_atomically
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Pool

CHECKOUT_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""examples/ of a source checkout (and of an editable install, which runs from one)."""
DEMO_SPECS = ("digits-a.yaml", "digits-b.yaml")
DEMO_SCRIPT = "train_digits.py"
"""What the demo's jobs run, as `python examples/train_digits.py` from their workingDir."""
TORCHRUN_SCRIPT = "train_torchrun.py"
"""What they run under `--engine torchrun`: the same training as a plain torchrun script."""
DEMO_MARKER = ".herd-demo"


class DemoFailed(Exception):
    pass


def say(message: str) -> None:
    print(f"demo: {message}", flush=True)


def prepare_state_dir(state_dir: Path) -> None:
    """Start from a clean demo state, but never wipe a directory the demo did not make."""
    if state_dir.exists() and any(state_dir.iterdir()):
        if not (state_dir / DEMO_MARKER).exists():
            raise DemoFailed(
                f"{state_dir} exists and is not a demo state directory; pass another --state-dir"
            )
        shutil.rmtree(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / DEMO_MARKER).write_text("made by `herd-operator demo`; safe to delete\n")


def find_examples() -> Path | None:
    """The directory holding the demo's example specs and training script, or None.

    An installed package carries them as ``herd_operator.examples`` (package data built
    from examples/); a source checkout has them in examples/ beside the packages.
    """
    packaged = Path(str(importlib.resources.files("herd_operator"))) / "examples"
    for candidate in (packaged, CHECKOUT_EXAMPLES):
        if _has_demo_files(candidate):
            return candidate
    return None


def _has_demo_files(directory: Path) -> bool:
    wanted = [directory / "specs" / name for name in DEMO_SPECS] + [directory / DEMO_SCRIPT]
    return all(path.is_file() for path in wanted)


def on_torchrun(document: dict[str, Any]) -> dict[str, Any]:
    """An example spec of the Horovod script as the same job on the torchrun engine: the
    torchrun script with the same arguments, its snapshot named after the job."""
    spec = dict(document["spec"])
    python, script, *args = spec["command"]
    if Path(script).name != DEMO_SCRIPT:
        raise DemoFailed(f"{document['metadata']['name']}: not a job of {DEMO_SCRIPT}")
    snapshot = f"{document['metadata']['name']}.pt"
    spec["command"] = [python, str(Path(script).with_name(TORCHRUN_SCRIPT)), *args,
                       "--snapshot", snapshot]  # fmt: skip
    spec["engine"] = {"kind": "torchrun"}
    return {**document, "spec": spec}


def stage_examples(examples: Path, state_dir: Path, engine: str = "horovod") -> Path:
    """Copy what the demo's jobs run into ``state_dir``; returns their working directory.

    The jobs run from the demo's own directory, never from site-packages (which may be
    read-only, and is no place for a run's files).
    """
    target = state_dir / "examples"
    (target / "specs").mkdir(parents=True, exist_ok=True)
    shutil.copy2(examples / DEMO_SCRIPT, target / DEMO_SCRIPT)
    if engine == "torchrun":
        shutil.copy2(examples / TORCHRUN_SCRIPT, target / TORCHRUN_SCRIPT)
    for name in DEMO_SPECS:
        shutil.copy2(examples / "specs" / name, target / "specs" / name)
    return state_dir


def place_spec(
    example: str, examples: Path, working_dir: Path, jobs_dir: Path, engine: str = "horovod"
) -> None:
    """Copy an example spec into the watched directory, atomically, to run from working_dir
    on `engine`."""
    document = yaml.safe_load((examples / "specs" / example).read_text())
    if engine == "torchrun":
        document = on_torchrun(document)
    document["spec"]["workingDir"] = str(working_dir)
    write_atomically(jobs_dir / example, yaml.safe_dump(document, sort_keys=False))


class Watch:
    def __init__(self, database: Path, deadline: float) -> None:
        self.database = database
        self.deadline = deadline

    def job(self, name: str) -> dict[str, Any]:
        with Store.open_readonly(self.database) as store:
            record = store.get_job(name)
        return job_object(record) if record is not None else {}

    def condition(self, name: str, type: str) -> bool:
        return any(
            c["type"] == type and c["status"] == "True"
            for c in self.job(name).get("conditions", [])
        )

    def until(self, what: str, probe: Callable[[], bool]) -> None:
        while not probe():
            if time.monotonic() > self.deadline:
                raise DemoFailed(f"timed out waiting for {what}")
            time.sleep(0.5)


def summary(database: Path, started: float) -> str:
    with Store.open_readonly(database) as store:
        records = store.list_jobs()
        trimmed = store.trimmed_history()
        rows = [["JOB", "STATUS", "MIN", "MAX", "EPOCHS", "GPUS OVER TIME", "RESTARTS", "RAN FOR"]]
        for record in records:
            obj = job_object(record)
            changes = store.grant_history(record.name)
            history = [change.gpus for change in changes]
            timeline = " -> ".join(str(gpus) for gpus in history if gpus) or "-"
            if record.name in trimmed:  # the bound dropped its oldest changes
                timeline = "... -> " + timeline
            ran = ""
            if history:
                first = changes[0].time
                ran = f"{(record.updated_at - first):.0f}s"
            rows.append(
                [
                    record.name,
                    obj["status"],
                    str(obj["gpus"]["min"]),
                    str(obj["gpus"]["max"]),
                    dash(epochs_completed(obj["epoch"])),  # as `get -o wide` shows it
                    timeline,
                    str(obj["restarts"]),
                    ran,
                ]
            )
        events = store.events(limit=1000)
    lines = [f"Summary after {time.monotonic() - started:.0f}s:", format_table(rows), ""]
    lines.append("Decisions and events:")
    event_rows = [["AT", "JOB", "REASON", "MESSAGE"]]
    first_event = events[0].time if events else 0.0
    for event in events:
        event_rows.append(
            [f"+{event.time - first_event:5.1f}s", event.job or "-", event.reason, event.message]
        )
    lines.append(format_table(event_rows))
    return "\n".join(lines)


def run_demo(state_dir: Path, virtual_gpus: int, timeout: float, engine: str = "horovod") -> int:
    examples = find_examples()
    if examples is None:
        print(
            "herd-operator demo: the example jobs are missing from this installation"
            f" (looked in the package's examples/ and {CHECKOUT_EXAMPLES});"
            " reinstall herd-operator, or run the demo from a source checkout",
            file=sys.stderr,
        )
        return 1
    try:
        prepare_state_dir(state_dir)
    except DemoFailed as err:
        print(f"herd-operator demo: {err}", file=sys.stderr)
        return 1
    working_dir = stage_examples(examples, state_dir, engine).resolve()
    jobs_dir = state_dir / "jobs"
    jobs_dir.mkdir(exist_ok=True)
    layout = StateLayout(state_dir / "state")
    pool = Pool.from_counts({"localhost": virtual_gpus})
    config = OperatorConfig(
        specs_dir=jobs_dir,
        state_dir=layout.root,
        pool=StaticPool(pool, True, f"localhost: {virtual_gpus} virtual GPUs (demo)"),
        resync_seconds=1.0,
        relist_seconds=2.0,
        grace_seconds=5.0,
        min_resize_interval=5.0,
    )
    operator = Operator(config)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        say("interrupted; stopping the jobs")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    thread = threading.Thread(target=operator.run, args=(stop,), name="operator")
    started = time.monotonic()
    thread.start()
    watch = Watch(layout.database, started + timeout)
    code = 0
    try:
        if not operator.ready.wait(60):
            raise DemoFailed("the operator did not start")
        say(f"operator up on {virtual_gpus} virtual GPUs; state in {layout.root}; {engine} jobs")
        say("1. digits-a (elastic, 1..3 GPUs) arrives: admitted, 3 workers start")
        place_spec("digits-a.yaml", examples, working_dir, jobs_dir, engine)
        watch.until(
            "digits-a to report 3 workers",
            lambda: watch.job("digits-a").get("gpus", {}).get("active") == 3,
        )
        watch.until(
            "digits-a's second epoch", lambda: (watch.job("digits-a").get("epoch") or 0) >= 1
        )
        say("2. digits-b (gang, needs 2 GPUs) arrives: digits-a shrinks to make room")
        place_spec("digits-b.yaml", examples, working_dir, jobs_dir, engine)
        watch.until(
            "digits-b to run",
            lambda: (
                watch.condition("digits-b", "Running") or watch.condition("digits-b", "Succeeded")
            ),
        )
        watch.until(
            "digits-a to train on 2 workers",
            lambda: (
                watch.job("digits-a").get("gpus", {}).get("active") == 2
                or watch.condition("digits-a", "Succeeded")
            ),
        )
        watch.until(
            "digits-b to finish",
            lambda: (
                watch.condition("digits-b", "Succeeded") or watch.condition("digits-b", "Failed")
            ),
        )
        if watch.condition("digits-a", "Succeeded") or watch.condition("digits-a", "Failed"):
            # On a loaded machine digits-a can run out of epochs first: say what happened.
            say("3. digits-b finished after digits-a had: no job is left to grow")
        else:
            say("3. digits-b finished: its GPUs go back to digits-a, which grows to 3 again")
        watch.until(
            "digits-a to finish",
            lambda: (
                watch.condition("digits-a", "Succeeded") or watch.condition("digits-a", "Failed")
            ),
        )
        if not all(watch.condition(job, "Succeeded") for job in ("digits-a", "digits-b")):
            raise DemoFailed(
                "a job failed; see `herd-operator describe` and the logs in " + str(layout.logs_dir)
            )
        say("4. both jobs finished")
    except DemoFailed as err:
        say(f"FAILED: {err}")
        code = 1
    finally:
        stop.set()
        thread.join()
    print()
    print(summary(layout.database, started))
    print()
    say(f"look around: herd-operator get -o wide --state-dir {layout.root}")
    return code
