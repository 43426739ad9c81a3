"""Each job to the engine its spec names: the allocator's placement sink and the
controllers' launcher port.

Neither the allocator nor the reconciler knows engines: the allocator hands every
placement to `EngineDispatch`, the reconciler starts and questions jobs through
`JobLauncher`, and both route a job to the engine of the spec it was started with.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from controllers.errors import PermanentError
from controllers.ports import LaunchInfo, ProcessState
from herd_operator.environment import JOB_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import plain_presentation
from herd_operator.runtime.engines import (
    Engine,
    EngineContext,
    UnknownEngineError,
    engine_factory,
)
from herd_operator.runtime.launcher import Launcher, LaunchRequest
from specs import HerdJob
from specs.values import Placement, Slot

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

    def present(self, job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
        """The placement under the names the job's engine shows it to its workers."""
        with self._lock:
            engine = self._job_engines.get(job)
        if engine is None:
            return plain_presentation(job, placement)
        return engine.present(job, placement)

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
            if engine is not None:
                engine.withdraw(job)


class JobLauncher:
    """The controllers' `LauncherPort`: each job started and questioned through its engine,
    its processes supervised by the engine-blind `Launcher`."""

    def __init__(
        self,
        launcher: Launcher,
        engines: EngineDispatch,
        layout: StateLayout,
        env: Mapping[str, str],
    ) -> None:
        self._launcher = launcher
        self._engines = engines
        self._layout = layout
        self._env = env

    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo:
        engine = self._engine(job)
        self._engines.attach(job.name, engine)
        env = {**job.spec.env, **self._env, JOB_ENV: job.name}
        env.update(engine.environment(job, {**os.environ, **env}))
        request = LaunchRequest(
            job=job.name,
            generation=generation,
            argv=engine.launch_argv(job, np),
            log_file=self._layout.log_file(job.name),
            command=engine.command,
            spec=job.spec,
            env=env,
            working_dir=job.spec.working_dir,
        )
        info = self._launcher.launch(request)
        log.info(
            "launched %s: %s pid %d, %d workers, log %s",
            job.name,
            engine.command,
            info.pid,
            np,
            request.log_file,
        )
        return info

    def state(self, name: str) -> ProcessState:
        return self._launcher.state(name)

    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        launched, wanted = launch.spec.engine.kind, job.spec.engine.kind
        if launched != wanted:
            return f"engine.kind changed from {launched} to {wanted}"
        return self._engine(job).relaunch_reason(launch.spec, job.spec)

    def stop(self, name: str) -> None:
        self._launcher.stop(name)

    def forget(self, name: str) -> None:
        self._launcher.forget(name)

    def _engine(self, job: HerdJob) -> Engine:
        try:
            return self._engines.engine(job.spec.engine.kind)
        except UnknownEngineError as err:
            # Specs with an unknown kind are refused when loaded; this is a last good spec
            # recorded by an operator that had the engine.
            raise PermanentError(f"{err.field}: {err}", reason="EngineUnavailable") from err
