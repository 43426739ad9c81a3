"""Each job to the engine its spec names: the allocator's placement sink and the
controllers' launcher port.

Neither the allocator nor the reconciler knows engines: the allocator hands every
placement to `EngineDispatch`, the reconciler starts and questions jobs through
`JobLauncher`, and both route a job to the engine of the spec it was started with.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping

from herd_operator.auth import job_key, write_token_file
from herd_operator.controllers.errors import PermanentError
from herd_operator.controllers.ports import LaunchInfo, ProcessState
from herd_operator.environment import (
    BATCH_POLICY_ENV,
    ENV_FILE_ENV,
    GPU_MEMORY_LIMIT_ENV,
    JOB_ENV,
    MAX_BATCH_ENV,
    MAX_WORKER_BATCH_ENV,
    MEASURE_STEPS_ENV,
    OPERATOR_SET,
    TOKEN_FILE_ENV,
    TRAINING_ENV,
    WARMUP_STEPS_ENV,
)
from herd_operator.layout import StateLayout, write_atomically
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.bindings import plain_presentation
from herd_operator.runtime.engines import (
    Engine,
    EngineContext,
    UnknownEngineError,
    engine_factory,
)
from herd_operator.runtime.launcher import Launcher, LaunchRequest
from herd_operator.runtime.process_table import agent_names
from herd_operator.specs import HerdJob
from herd_operator.specs.values import Placement, ResizeMode, Slot

log = logging.getLogger(__name__)


class EngineDispatch:
    """The allocator's `PlacementSink`: hands each job's placement to the engine that runs it.

    The allocator decides a job's first placement before the job starts, and which engine
    runs a job is settled when it starts. So the latest placement of every job is kept, and
    a job's engine gets it when the job is attached to it, before its processes start
    (Horovod's discovery script must find the grant at once).
    """

    def __init__(self, context: EngineContext) -> None:
        self.context = context
        self._lock = threading.Lock()
        self._engines: dict[str, Engine] = {}
        self._job_engines: dict[str, Engine] = {}
        self._placements: dict[str, Placement] = {}
        # job -> (engine, placement, its presentation): every worker's bind asks for it,
        # and computing it is linear in the placement (a burst of binds was quadratic).
        self._presented: dict[str, tuple[Engine, Placement, dict[str, tuple[Slot, ...]]]] = {}

    def engine(self, kind: str) -> Engine:
        """This operator's engine of `kind`, made on first use; raises UnknownEngineError."""
        with self._lock:
            engine = self._engines.get(kind)
            if engine is None:
                engine = self._engines[kind] = engine_factory(kind)(self.context)
            return engine

    def attach(self, job: str, engine: Engine) -> None:
        """`job` runs on `engine` from now on; the engine gets its current placement first."""
        with self._lock:
            previous = self._job_engines.get(job)
            if previous is engine:
                return
            if previous is not None:
                previous.withdraw(job)
            self._job_engines[job] = engine
            placement = self._placements.get(job)
            if placement is not None:
                engine.publish(job, placement)

    def adopt(self, job: str, kind: str) -> None:
        """`job` was started by a previous operator on the engine of `kind`: attach it."""
        try:
            engine = self.engine(kind)
        except UnknownEngineError:
            log.warning("%s: adopted, but this operator has no engine %r", job, kind)
            return
        self.attach(job, engine)

    def present(self, job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
        """The placement under the names the job's engine shows it to its workers."""
        with self._lock:
            engine = self._job_engines.get(job)
            cached = self._presented.get(job)
        if engine is None:
            return plain_presentation(job, placement)
        # Placements are immutable and a new grant is a new object: identity is enough.
        if cached is not None and cached[0] is engine and cached[1] is placement:
            return cached[2]
        presented = engine.present(job, placement)
        with self._lock:
            if self._job_engines.get(job) is engine:
                self._presented[job] = (engine, placement, presented)
        return presented

    def agents(self, job: str) -> frozenset[str]:
        """The names of `job`'s GPUs on this host whose agent runs (the torchrun engine's; a
        Horovod job has none): the allocator's evidence that a membership is still forming
        (`world_sizes.standing`). Read from the process table, only when a loss is judged."""
        return agent_names(self.context.layout.root, job)

    def publish(self, job: str, placement: Placement) -> None:
        with self._lock:
            self._placements[job] = placement
            engine = self._job_engines.get(job)
            if engine is not None:
                engine.publish(job, placement)

    def withdraw(self, job: str) -> None:
        with self._lock:
            self._placements.pop(job, None)
            engine = self._job_engines.pop(job, None)
            self._presented.pop(job, None)
            if engine is not None:
                engine.withdraw(job)


def training_env(job: HerdJob) -> dict[str, str]:
    """`spec.training` as the variables the worker API reads (none when it is unset)."""
    training = job.spec.training
    if training is None or not training.tells_workers():  # `epochs`, `resumable` are not theirs
        return {}
    env: dict[str, str] = {BATCH_POLICY_ENV: training.batch_policy}
    if training.warmup_steps is not None:
        env[WARMUP_STEPS_ENV] = str(training.warmup_steps)
    if training.max_worker_batch is not None:
        env[MAX_WORKER_BATCH_ENV] = str(training.max_worker_batch)
    if training.max_batch is not None:
        env[MAX_BATCH_ENV] = str(training.max_batch)
    if training.measure_steps is not None:
        env[MEASURE_STEPS_ENV] = str(training.measure_steps)
    return env


class JobLauncher:
    """The controllers' `LauncherPort`: each job started and questioned through its engine,
    its processes supervised by the engine-blind `Launcher`."""

    def __init__(
        self,
        launcher: Launcher,
        engines: EngineDispatch,
        layout: StateLayout,
        env: Mapping[str, str],
        master_token: bytes,
        sharing: SharingLimits | None = None,
    ) -> None:
        """`sharing`: the operator shares GPUs (`run --share-gpus`): a sharing job's
        workers are then limited to their memory request (`GPU_MEMORY_LIMIT_ENV`)."""
        self._sharing = sharing
        self._launcher = launcher
        self._engines = engines
        self._layout = layout
        self._env = env
        self._master_token = master_token

    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo:
        engine = self._engine(job)
        self._engines.attach(job.name, engine)
        env, worker_env = self._environments(job, engine)
        # The job's own key, never the master token: its processes can speak for this job
        # and no other. The same on every launch, and after an operator restart.
        token_file = self._layout.job_token_file(job.name)
        write_token_file(token_file, job_key(self._master_token, job.name))
        env_file = self._layout.job_env_file(job.name)
        write_atomically(env_file, json.dumps(worker_env), mode=0o600)
        env[TOKEN_FILE_ENV] = str(token_file.resolve())
        env[ENV_FILE_ENV] = str(env_file.resolve())
        request = LaunchRequest(
            job=job.name,
            generation=generation,
            argv=engine.launch_argv(job, np),
            log_file=self._layout.log_file(job.name),
            command=engine.process_name(job),
            spec=job.spec,
            env=env,
            working_dir=job.spec.working_dir,
        )
        info = self._launcher.launch(request)
        log.info(
            "launched %s: %s pid %d, %d workers, log %s",
            job.name,
            info.command,
            info.pid,
            np,
            request.log_file,
        )
        return info

    def _environments(self, job: HerdJob, engine: Engine) -> tuple[dict[str, str], dict[str, str]]:
        """(the engine process's environment on top of the operator's, the spec's `env`).

        Horovod copies its whole environment onto each worker's command line, so the
        spec's values stay out of it and reach the workers through the shim. The
        operator's own variables win over the spec's, as do the engine's where it
        derives one from the spec's (PATH); such a derived value goes with the spec's.
        """
        env = {**self._env, JOB_ENV: job.name}
        gpus = job.spec.gpus
        if self._sharing is not None and gpus.share and gpus.memory_bytes is not None:
            # Torch OOMs in this job's worker past its request, not in a neighbour's.
            env[GPU_MEMORY_LIMIT_ENV] = str(gpus.memory_bytes)
        training = training_env(job)
        worker_env = {
            name: value
            for name, value in job.spec.env.items()
            if name not in env and name not in OPERATOR_SET and name not in TRAINING_ENV
        }
        worker_env.update(training)
        for name, value in engine.environment(job, {**os.environ, **worker_env, **env}).items():
            if name in worker_env:
                worker_env[name] = value
            else:
                env[name] = value
        return env, worker_env

    def state(self, name: str) -> ProcessState:
        return self._launcher.state(name)

    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        launched, wanted = launch.spec.engine.kind, job.spec.engine.kind
        if launched != wanted:
            return f"engine.kind changed from {launched} to {wanted}"
        return self._engine(job).relaunch_reason(launch.spec, job.spec)

    def resize_mode(self, kind: str) -> ResizeMode | None:
        try:
            return self._engines.engine(kind).resize_mode
        except UnknownEngineError:  # a job adopted from an operator that had the engine
            return None

    def stop(self, name: str) -> None:
        self._launcher.stop(name)

    def forget(self, name: str) -> None:
        self._launcher.forget(name)
        if name not in self._launcher.jobs():
            # No process of it is left to read them; a next launch writes them again.
            self._layout.job_env_file(name).unlink(missing_ok=True)
            self._layout.job_token_file(name).unlink(missing_ok=True)

    def _engine(self, job: HerdJob) -> Engine:
        try:
            return self._engines.engine(job.spec.engine.kind)
        except UnknownEngineError as err:
            # Specs with an unknown kind are refused when loaded; this is a last good spec
            # recorded by an operator that had the engine.
            raise PermanentError(f"{err.field}: {err}", reason="EngineUnavailable") from err
