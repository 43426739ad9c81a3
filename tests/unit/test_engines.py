"""The engine seam: a second engine needs only its module and one registry line.

`RecordingEngine` below is such an engine. Registered with one line, it is chosen by a
spec's `engine.kind` and driven by the real runtime (spec directory, reconciler, the
operator's job launcher and placement sink, the allocator, real processes), and it hears
of the launch, every placement, the relaunch question and the withdrawal. The rest: the
spec side of `engine` (unknown kinds, the legacy `horovod` field, conflicts, schema).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from pydantic import ValidationError

from herd_operator.auth import job_key, read_token_file
from herd_operator.cli.spec_commands import checked_sources
from herd_operator.controllers.errors import PermanentError
from herd_operator.controllers.ports import ProcessPhase
from herd_operator.controllers.reconciler import JobReconciler
from herd_operator.environment import ENV_FILE_ENV, TOKEN_FILE_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import plain_presentation
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import ENGINES, EngineContext, engine_factory
from herd_operator.runtime.engines.horovod import HorovodEngine
from herd_operator.runtime.launcher import Launcher
from herd_operator.runtime.specdir import SpecDirectory
from herd_operator.runtime.store import Store
from herd_operator.specs import (
    ConditionType,
    HerdJob,
    HerdJobSpec,
    get_condition,
    json_schema,
    load_spec_text,
    spec_fingerprint,
)
from herd_operator.specs.values import Demand, Placement, Pool, ResizeMode, Slot

# Hang guard for waiting on processes; never a performance expectation.
GUARD_S = 20.0
MASTER_TOKEN = bytes(range(32))


class RecordingEngine:
    """A test engine: runs a sleeping Python and records every call the runtime makes."""

    resize_mode = ResizeMode.RESTART

    def __init__(self, context: EngineContext) -> None:
        self.context = context
        self.calls: list[tuple[Any, ...]] = []

    def process_name(self, job: HerdJob) -> str:
        return "recorder"

    def launch_argv(self, job: HerdJob, np: int) -> list[str]:
        self.calls.append(("launch_argv", job.name, np, job.spec.engine.options))
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    def environment(self, job: HerdJob, env: Mapping[str, str]) -> dict[str, str]:
        self.calls.append(("environment", job.name, env["HERD_JOB"]))
        return {"RECORDED": "1"}

    def relaunch_reason(self, launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
        self.calls.append(("relaunch_reason", launched.engine.options, wanted.engine.options))
        return "recorder options changed" if launched.engine != wanted.engine else ""

    def present(self, job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
        return {host: tuple((host, gpu) for gpu in gpus) for host, gpus in placement.hosts}

    def publish(self, job: str, placement: Placement) -> None:
        self.calls.append(("publish", job, placement.size))

    def withdraw(self, job: str) -> None:
        self.calls.append(("withdraw", job))


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES, "recording", RecordingEngine)  # the one registry line


def job_yaml(name: str, engine: str = "", *, command: str = "[train]", high: int = 2) -> str:
    return (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
        f"metadata: {{name: {name}}}\n"
        f"spec:\n  command: {command}\n  gpus: {{min: 1, max: {high}}}\n"
        + (f"  engine: {engine}\n" if engine else "")
    )


@dataclass
class Runtime:
    """The operator's pieces, wired as `Operator._open` wires them, on 2 virtual GPUs."""

    jobs_dir: Path
    layout: StateLayout
    specs: SpecDirectory
    store: Store
    engines: EngineDispatch
    allocator: Allocator
    launcher: Launcher
    reconciler: JobReconciler

    def write(self, name: str, text: str) -> None:
        path = self.jobs_dir / f"{name}.yaml"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        self.specs.relist()

    def delete(self, name: str) -> None:
        (self.jobs_dir / f"{name}.yaml").unlink()
        self.specs.relist()

    def reconcile_until(self, name: str, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + GUARD_S
        while True:
            self.reconciler.reconcile(name)
            if done():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def events(self, name: str) -> list[tuple[str, str]]:
        return [(event.reason, event.message) for event in self.store.events(name)]

    def condition(self, name: str, condition_type: ConditionType) -> tuple[str, str]:
        record = self.store.get_job(name)
        assert record is not None
        found = get_condition(record.status.conditions, condition_type)
        assert found is not None
        return found.status.value, found.message


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    layout = StateLayout(tmp_path / "state")
    layout.create()
    engines = EngineDispatch(EngineContext(layout, ("localhost",)))
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}), engines, virtual=True, drain_seconds=0
    )
    launcher = Launcher(grace_seconds=1)
    job_launcher = JobLauncher(
        launcher, engines, layout, {"HERD_STATE_DIR": str(layout.root)}, MASTER_TOKEN
    )
    specs = SpecDirectory(jobs_dir)
    with Store(layout.database) as store:
        reconciler = JobReconciler(specs, store, allocator, job_launcher, stop_poll_seconds=0.05)
        yield Runtime(jobs_dir, layout, specs, store, engines, allocator, launcher, reconciler)
        launcher.stop_all(timeout=GUARD_S)


def test_a_registered_engine_gets_the_launch_the_placements_and_the_relaunch_question(
    recording: None, runtime: Runtime
) -> None:
    runtime.write("a", job_yaml("a", "{kind: recording, options: {speed: 1}}"))

    runtime.reconciler.reconcile("a")

    engine = runtime.engines.engine("recording")
    assert isinstance(engine, RecordingEngine)
    assert engine.context.hosts == ("localhost",)
    # The first grant was decided before the start; the engine gets it before launching.
    assert engine.calls == [
        ("publish", "a", 2),
        ("environment", "a", "a"),
        ("launch_argv", "a", 2, {"speed": 1}),
    ]
    state = runtime.launcher.state("a")
    assert state.phase is ProcessPhase.RUNNING and state.launch is not None
    assert state.launch.command == "recorder"
    assert runtime.events("a") == [("Started", f"recorder pid {state.launch.pid} with 2 workers")]
    assert list(runtime.layout.grants_dir.iterdir()) == []  # no Horovod grant files

    engine.calls.clear()
    runtime.allocator.request(Demand("other", 1, 1, 1))  # a running job's placement changes
    assert engine.calls == [("publish", "a", 1)]

    engine.calls.clear()
    runtime.reconciler.reconcile("a")  # same spec: asked, and no relaunch
    assert engine.calls == [("relaunch_reason", {"speed": 1}, {"speed": 1})]

    engine.calls.clear()
    runtime.write("a", job_yaml("a", "{kind: recording, options: {speed: 2}}"))
    runtime.reconciler.reconcile("a")
    assert engine.calls == [("relaunch_reason", {"speed": 1}, {"speed": 2})]
    assert runtime.events("a")[-1] == ("Relaunching", "recorder options changed")

    runtime.reconcile_until(
        "a", lambda: ("launch_argv", "a", 1, {"speed": 2}) in engine.calls, "the relaunch"
    )

    runtime.delete("a")
    runtime.reconcile_until("a", lambda: runtime.store.get_job("a") is None, "the deletion")
    assert engine.calls[-1] == ("withdraw", "a")
    assert runtime.allocator.grant("a") is None


def test_what_a_resize_does_to_the_workers_is_the_engines_word(
    recording: None, runtime: Runtime
) -> None:
    """The seam: each engine says what its resizes do to the workers (`resize_mode`); the
    reconciler asks its launcher port, knowing no engine, and the resize's event says it.
    Before, the controllers kept a list of engine names whose resizes restart workers."""
    port = runtime.reconciler.launcher
    assert port.resize_mode("horovod") is ResizeMode.LIVE
    assert port.resize_mode("torchrun") is ResizeMode.RESTART
    assert port.resize_mode("nope") is None
    runtime.write("a", job_yaml("a", "{kind: recording}"))
    runtime.reconciler.reconcile("a")  # started on both GPUs
    runtime.store.add_report("a", 0, 2, 0, {}, time.time())
    runtime.reconciler.reconcile("a")

    runtime.allocator.request(Demand("other", 1, 1, 1))  # one of its GPUs goes to another job
    runtime.reconciler.reconcile("a")  # Resizing 2 -> 1
    runtime.store.add_report("a", None, 1, 0, {}, time.time())
    runtime.reconciler.reconcile("a")

    [told] = [message for reason, message in runtime.events("a") if reason == "ResizeCompleted"]
    assert told.startswith("2 -> 1 workers in ") and told.endswith(" s (every worker restarted)")
    record = runtime.store.get_job("a")
    assert record is not None and record.status.last_resize is not None
    assert (record.status.last_resize.engine, record.status.last_resize.mode) == (
        "recording",
        ResizeMode.RESTART,
    )


def test_changing_the_engine_kind_relaunches_on_the_new_engine(
    recording: None, runtime: Runtime
) -> None:
    runtime.write("a", job_yaml("a", "{kind: recording}"))
    runtime.reconciler.reconcile("a")
    recorder = runtime.engines.engine("recording")
    assert isinstance(recorder, RecordingEngine)
    recorder.calls.clear()

    runtime.write("a", job_yaml("a", "{kind: horovod}"))
    runtime.reconciler.reconcile("a")
    assert runtime.events("a")[-1] == (
        "Relaunching",
        "engine.kind changed from recording to horovod",
    )
    assert recorder.calls == []  # the kinds differ: no engine is asked

    # The horovod engine takes the job over: the recorder withdraws, the grant file appears.
    runtime.engines.attach("a", runtime.engines.engine("horovod"))
    assert recorder.calls[-1] == ("withdraw", "a")
    horovod = runtime.engines.engine("horovod")
    assert isinstance(horovod, HorovodEngine)
    slots = horovod.present("a", Placement((("localhost", (0, 1)),)))
    assert runtime.layout.grant_file("a").read_text() == "".join(
        f"{name}:{len(named)}\n" for name, named in slots.items()
    )


def test_an_unknown_kind_is_a_spec_error_and_never_starts(runtime: Runtime) -> None:
    runtime.write("a", job_yaml("a", "{kind: nope}"))
    view = runtime.specs.view("a")
    assert view is not None and view.job is None
    message = "spec.engine.kind: unknown engine kind 'nope' (known: horovod, torchrun)"
    assert view.errors == (f"{runtime.jobs_dir / 'a.yaml'}: {message}",)

    runtime.reconciler.reconcile("a")

    assert runtime.launcher.state("a").phase is ProcessPhase.ABSENT
    assert runtime.store.get_job("a") is None  # never valid: it does not exist
    assert runtime.allocator.grant("a") is None


def test_a_spec_turning_to_an_unknown_kind_keeps_the_last_good_one(
    recording: None, runtime: Runtime
) -> None:
    runtime.write("a", job_yaml("a", "{kind: recording}"))
    runtime.reconciler.reconcile("a")
    runtime.write("a", job_yaml("a", "{kind: nope}"))

    runtime.reconciler.reconcile("a")

    status, message = runtime.condition("a", ConditionType.SpecValid)
    assert status == "False"
    assert (
        "spec.engine.kind: unknown engine kind 'nope' (known: horovod, recording, torchrun)"
        in message
    )
    assert message.endswith("(keeping the last good spec)")
    assert runtime.launcher.state("a").phase is ProcessPhase.RUNNING


def test_a_last_good_spec_whose_engine_is_gone_is_a_permanent_error(
    recording: None, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_launcher = runtime.reconciler.launcher
    job = load_spec_text(job_yaml("a", "{kind: recording}"), "a.yaml").job
    assert job is not None
    monkeypatch.delitem(ENGINES, "recording")
    with pytest.raises(PermanentError) as caught:
        job_launcher.start(job, 1, 1)
    assert caught.value.reason == "EngineUnavailable"
    assert str(caught.value) == (
        "spec.engine.kind: unknown engine kind 'recording' (known: horovod, torchrun)"
    )


def test_registry_lookup_names_the_known_kinds(recording: None) -> None:
    assert engine_factory("horovod") is HorovodEngine
    assert engine_factory("recording") is RecordingEngine
    with pytest.raises(
        LookupError, match=r"^unknown engine kind 'x' \(known: horovod, recording, torchrun\)$"
    ):
        engine_factory("x")


def test_validate_reports_an_unknown_kind(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(job_yaml("a", "{kind: nope}"), encoding="utf-8")
    _, problems = checked_sources([str(path)], io.StringIO())
    assert problems == [
        f"{path}: spec.engine.kind: unknown engine kind 'nope' (known: horovod, torchrun)"
    ]


# ---- the spec side ----

HOROVOD = {"elasticTimeoutSeconds": 30, "resetLimit": 2, "extraArgs": ["--verbose"]}


def document(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "a"},
        "spec": {"command": ["x"], "gpus": {"min": 1, "max": 2}, **spec},
    }


def errors_of(**spec: Any) -> list[str]:
    loaded = load_spec_text(yaml.safe_dump(document(**spec)), "a.yaml")
    assert loaded.job is None
    return [f"{error.field}: {error.message}" for error in loaded.errors]


def test_the_legacy_horovod_field_means_the_horovod_engines_options() -> None:
    legacy = HerdJob.model_validate(document(horovod=HOROVOD))
    engine = HerdJob.model_validate(document(engine={"kind": "horovod", "options": HOROVOD}))
    kind_left_out = HerdJob.model_validate(document(engine={"options": HOROVOD}))
    both = HerdJob.model_validate(document(horovod=HOROVOD, engine={"options": HOROVOD}))
    for job in (legacy, engine, kind_left_out, both):
        assert job.spec.engine.kind == "horovod"
        assert job.spec.horovod == legacy.spec.horovod
        assert job.spec.horovod.elastic_timeout_seconds == 30
        assert job.spec.model_dump(exclude={"engine"}) == legacy.spec.model_dump(exclude={"engine"})
        assert spec_fingerprint(job) == spec_fingerprint(legacy)
        # What the store keeps reads back as the same spec.
        assert HerdJob.model_validate_json(job.model_dump_json(by_alias=True)) == job


def test_empty_engine_options_give_none() -> None:
    job = HerdJob.model_validate(
        document(horovod={"resetLimit": 2}, engine={"kind": "horovod", "options": {}})
    )
    assert job.spec.horovod.reset_limit == 2
    assert spec_fingerprint(job) == spec_fingerprint(
        HerdJob.model_validate(document(horovod={"resetLimit": 2}))
    )


def test_fingerprints_of_specs_from_before_the_engine_field_do_not_change() -> None:
    # The hash of the spec's canonical JSON as it was before `engine` (no such key).
    spec = {
        "command": ["x"],
        "env": {},
        "gpus": {"max": 2, "min": 1},
        "horovod": {"elasticTimeoutSeconds": 30, "extraArgs": [], "resetLimit": None},
        "policy": {"name": "static", "params": {}},
        "priority": 0,
        "restartPolicy": {"backoffLimit": 3, "onFailure": False},
        "workingDir": None,
    }
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    before = hashlib.sha256(canonical.encode()).hexdigest()
    job = HerdJob.model_validate(document(horovod={"elasticTimeoutSeconds": 30}))
    assert spec_fingerprint(job) == before


def test_choosing_the_bare_horovodrun_launcher_is_a_new_spec() -> None:
    default = HerdJob.model_validate(document())
    assert default.spec.horovod.launcher == "driver"
    explicit = HerdJob.model_validate(document(horovod={"launcher": "driver"}))
    bare = HerdJob.model_validate(document(horovod={"launcher": "horovodrun"}))
    assert spec_fingerprint(explicit) == spec_fingerprint(default)
    assert spec_fingerprint(bare) != spec_fingerprint(default)
    assert errors_of(horovod={"launcher": "mpirun"}) == [
        "spec.horovod.launcher: must be 'driver' or 'horovodrun', got string 'mpirun'"
    ]


def test_another_kinds_options_are_its_own_and_count_in_the_fingerprint() -> None:
    job = HerdJob.model_validate(document(engine={"kind": "other", "options": {"a": [1]}}))
    assert job.spec.engine.options == {"a": [1]}
    other = HerdJob.model_validate(document(engine={"kind": "other", "options": {"a": [2]}}))
    assert spec_fingerprint(job) != spec_fingerprint(other)
    assert HerdJob.model_validate_json(job.model_dump_json(by_alias=True)) == job


def test_horovod_options_under_engine_are_validated_with_their_path() -> None:
    assert errors_of(engine={"options": {"elasticTimeoutSeconds": 0, "timeout": 5}}) == [
        "spec.engine.options.elasticTimeoutSeconds: must be greater than 0, got integer 0",
        "spec.engine.options.timeout: unknown field "
        "(allowed: elasticTimeoutSeconds, glooTimeoutSeconds, growTimeoutSeconds, "
        "resetLimit, extraArgs, launcher, preload)",
    ]


def test_conflicting_horovod_and_engine_options_are_an_error_naming_both() -> None:
    (error,) = errors_of(horovod={"resetLimit": 2}, engine={"options": {"resetLimit": 1}})
    assert error.startswith(
        "spec: horovod and engine.options both give the horovod engine's options, and they differ: "
    )
    assert error.endswith("; keep one of them")


def test_horovod_options_with_another_engine_kind_are_an_error() -> None:
    assert errors_of(horovod={"resetLimit": 2}, engine={"kind": "other"}) == [
        "spec: horovod: options of the horovod engine only, but engine.kind is 'other' "
        "(its options go under engine.options)"
    ]


def test_the_readme_example_spec_validates() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    example = readme.split("# jobs/resnet.yaml\n", 1)[1].split("```", 1)[0]
    loaded = load_spec_text(example, "README.md")
    assert loaded.job is not None, loaded.errors
    assert loaded.job.spec.engine.kind == "horovod"
    assert loaded.job.spec.horovod.elastic_timeout_seconds == 600


@pytest.mark.parametrize("kind", ["Horovod", "", "my engine", "mod:Class"])
def test_engine_kind_must_be_a_name(kind: str) -> None:
    with pytest.raises(ValidationError):
        HerdJob.model_validate(document(engine={"kind": kind}))


def test_schema_describes_the_horovod_options_under_engine() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json_schema()
    assert "HorovodOptions" in schema["$defs"]
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(document(engine={"options": HOROVOD}))) == []
    assert list(validator.iter_errors(document(engine={"kind": "x", "options": {"a": 1}}))) == []
    bad = document(engine={"kind": "horovod", "options": {"elasticTimeoutSeconds": 0}})
    assert [error.message for error in validator.iter_errors(bad)] == [
        "0 is less than or equal to the minimum of 0"
    ]
    bad = document(engine={"options": {"timeout": 1}})
    assert len(list(validator.iter_errors(bad))) == 1


def test_a_launch_gets_its_own_key_and_the_spec_env_by_file_only(
    recording: None, runtime: Runtime
) -> None:
    marker = "spec-env-marker-5c1e"
    env = {"SECRET": marker, "RECORDED": f"{marker}-2", TOKEN_FILE_ENV: f"/tmp/{marker}"}
    runtime.write("a", job_yaml("a", "{kind: recording}") + f"  env: {json.dumps(env)}\n")

    runtime.reconciler.reconcile("a")

    state = runtime.launcher.state("a")
    assert state.launch is not None
    process = psutil.Process(state.launch.pid)
    environ = process.environ()
    assert not [name for name, value in environ.items() if marker in value]
    assert not [arg for arg in process.cmdline() if marker in arg]
    # The job's key, not the master token; the same key a restarted operator derives.
    token_file = runtime.layout.job_token_file("a")
    assert environ[TOKEN_FILE_ENV] == str(token_file.resolve())
    assert read_token_file(token_file) == job_key(MASTER_TOKEN, "a") != MASTER_TOKEN
    # The spec's env, for the shim: what the engine derives from a spec value goes with it,
    # and the operator's own variables are not the spec's to set.
    env_file = Path(environ[ENV_FILE_ENV])
    assert env_file == runtime.layout.job_env_file("a").resolve()
    assert json.loads(env_file.read_text()) == {"SECRET": marker, "RECORDED": "1"}
    assert "RECORDED" not in environ
    for path in (token_file, env_file):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    # Once no process of the job is left, neither is its key nor its env.
    runtime.delete("a")
    runtime.reconcile_until("a", lambda: runtime.store.get_job("a") is None, "the deletion")
    assert not token_file.exists() and not env_file.exists()


def test_dispatch_presents_a_placement_as_the_engine_attached_now_shows_it(
    tmp_path: Path,
) -> None:
    """Every bind asks for the job's presentation, so it is kept per placement; a new
    engine or none must not be answered from what the previous one presented."""
    layout = StateLayout(tmp_path / "state")
    layout.create()
    engines = EngineDispatch(EngineContext(layout, ("localhost",)))
    placement = Placement((("localhost", (0, 1)),))
    plain = plain_presentation("a", placement)
    assert engines.present("a", placement) == plain
    horovod = engines.engine("horovod")
    engines.attach("a", horovod)
    shown = horovod.present("a", placement)
    assert shown != plain  # the local host's second name holds GPU 1
    assert engines.present("a", placement) == shown
    assert engines.present("a", placement) is engines.present("a", placement)  # kept
    engines.withdraw("a")
    assert engines.present("a", placement) == plain
