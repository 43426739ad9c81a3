"""How the operator wires GPU sharing's two halves: the sharing jobs' memory requests are the
shares their workers are warned against and limited to, only when the operator shares GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd_operator.environment import GPU_MEMORY_LIMIT_ENV
from herd_operator.layout import StateLayout
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.launcher import Launcher
from herd_operator.runtime.specdir import SpecDirectory
from herd_operator.runtime.telemetry import RequestedShares, requested_shares


def _spec(name: str, gpus: str) -> str:
    return (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
        f"metadata: {{name: {name}}}\n"
        f"spec:\n  command: [train]\n  gpus: {gpus}\n"
    )


@pytest.fixture
def specs(tmp_path: Path) -> SpecDirectory:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "asked.yaml").write_text(_spec("asked", "{min: 1, max: 2, share: true, memory: 2Gi}"))
    (jobs / "measured.yaml").write_text(_spec("measured", "{min: 1, max: 1, share: true}"))
    (jobs / "whole.yaml").write_text(_spec("whole", "{min: 1, max: 1, memory: 4Gi}"))
    directory = SpecDirectory(jobs)
    directory.relist()
    return directory


def test_only_a_sharing_job_with_a_request_has_a_share(specs: SpecDirectory) -> None:
    assert requested_shares(specs) == {"asked": 2 * 1024**3}
    assert requested_shares(None) == {}  # before the spec directory is read


def test_the_shares_are_read_again_only_after_a_relist_changed_a_job(specs: SpecDirectory) -> None:
    shares = RequestedShares(lambda: specs)
    first = shares()
    assert first == {"asked": 2 * 1024**3}
    version = specs.version
    specs.relist()  # nothing changed: the round keeps what it read
    assert specs.version == version and shares() is first
    measured = specs.directory / "measured.yaml"
    measured.write_text(_spec("measured", "{min: 1, max: 1, share: true, memory: 1Gi}"))
    assert shares() is first, "an edit counts once a relist has read it, as for the reconciler"
    specs.relist()
    assert specs.version == version + 1
    assert shares() == {"asked": 2 * 1024**3, "measured": 1024**3}
    assert RequestedShares(lambda: None)() == {}  # before the spec directory is read


@pytest.mark.parametrize(
    ("sharing", "job", "limit"),
    [
        (SharingLimits(), "asked", str(2 * 1024**3)),
        (None, "asked", None),  # the operator does not share: the job has whole GPUs
        (SharingLimits(), "measured", None),  # no request: placed by its peak, not capped
        (SharingLimits(), "whole", None),  # does not opt in
    ],
)
def test_a_sharing_workers_limit_is_its_request_under_a_sharing_operator(
    tmp_path: Path, specs: SpecDirectory, sharing: SharingLimits | None, job: str, limit: str | None
) -> None:
    layout = StateLayout(tmp_path / "state")
    layout.create()
    engines = EngineDispatch(EngineContext(layout, ("localhost",)))
    launcher = JobLauncher(Launcher(grace_seconds=1), engines, layout, {}, b"k" * 32, sharing)
    view = specs.view(job)
    assert view is not None and view.job is not None
    env, worker_env = launcher._environments(view.job, engines.engine("horovod"))
    assert env.get(GPU_MEMORY_LIMIT_ENV) == limit
    assert GPU_MEMORY_LIMIT_ENV not in worker_env
