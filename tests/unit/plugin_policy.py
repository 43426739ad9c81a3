"""Policies outside the built-ins, and a real installed distribution that registers them.

`plugins_installed` writes a `*.dist-info` folder (what `pip install` leaves) whose
`entry_points.txt` names these classes under the `herd_operator.policies` group, and puts
its folder on sys.path: `importlib.metadata` finds it as it finds any installed package.
A subprocess finds it with that folder on its PYTHONPATH.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import BaseModel, ConfigDict, Field

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.policies.registry import ENTRY_POINT_GROUP, reset_plugin_cache
from herd_operator.specs import HerdJob

HERE = "tests.unit.plugin_policy"
EXAMPLE_PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
TEST_PLUGINS: dict[str, str] = {
    "half": f"{HERE}:HalfPolicy",
    "recording": f"{HERE}:RecordingPolicy",
    "legacy": f"{HERE}:LegacyPolicy",
    "legacy-usage": f"{HERE}:LegacyUsagePolicy",
    "slotted-legacy": f"{HERE}:SlottedLegacyPolicy",
    "slotted-legacy-usage": f"{HERE}:SlottedLegacyUsagePolicy",
    "bad-observes": f"{HERE}:BadObservesPolicy",
    "no-params": f"{HERE}:NoParamsPolicy",
    "missing-class": f"{HERE}:Missing",
    "missing-module": "no_such_module_here:Policy",
}
"""The entry points the test distribution registers: name -> `module:attribute`."""


def write_distribution(
    site: Path,
    project: str,
    points: Mapping[str, str],
    group: str = ENTRY_POINT_GROUP,
) -> Path:
    """Install the metadata of a distribution `project` registering `points` in `site`."""
    dist_info = site / f"{project.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1\n")
    lines = [f"[{group}]", *(f"{name} = {value}" for name, value in points.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dist_info


def write_distribution_of(pyproject: Path, site: Path) -> Path:
    """Install the metadata a project's pyproject.toml declares (its policy entry points)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    points: dict[str, str] = project["entry-points"][ENTRY_POINT_GROUP]
    return write_distribution(site, project["name"], points)


def install(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put `site` on sys.path and make the registry read the entry points again."""
    monkeypatch.syspath_prepend(str(site))
    reset_plugin_cache()


@pytest.fixture
def plugins_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The policies of this module, installed as a plug-in distribution; yields its folder."""
    site = tmp_path / "site-packages"
    write_distribution(site, "herd-test-plugins", TEST_PLUGINS)
    install(site, monkeypatch)
    yield site
    reset_plugin_cache()  # a later test must not see this distribution


@pytest.fixture
def example_plugin_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """examples/plugins installed as its pyproject.toml declares: the module on the path,
    the entry point in the distribution's metadata. Yields the metadata's folder."""
    site = tmp_path / "site-packages"
    write_distribution_of(EXAMPLE_PLUGINS / "pyproject.toml", site)
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGINS))
    install(site, monkeypatch)
    yield site
    reset_plugin_cache()


class HalfParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    round_up: bool = Field(default=False, strict=True)


class HalfPolicy:
    """Asks for half of the job's max, clamped into [min, max]."""

    observes: frozenset[Signal] = frozenset()

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        most = job.spec.gpus.max
        half = (most + 1) // 2 if self.params.round_up else most // 2
        gpus = clamp(job, half)
        return Decision(gpus, f"half: {gpus} of max {most}")


class RecordingPolicy:
    """Asks for max and keeps what it was shown, for the reconciler's tests."""

    observes = frozenset({Signal.EPOCHS})
    seen: ClassVar[list[JobObservations]] = []

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        self.seen.append(observed)
        return Decision(job.spec.gpus.max, "recording")


class LegacyPolicy:
    """A plug-in written before policies declared what they observe: it sees the epochs."""

    seen: ClassVar[list[JobObservations]] = []

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        self.seen.append(observed)
        return Decision(job.spec.gpus.max, f"legacy: {len(observed.epochs)} epochs")


class LegacyUsagePolicy(LegacyPolicy):
    """A plug-in of that time that asked for GPU usage the way the reconciler then looked."""

    needs_usage = True


class SlottedLegacyPolicy:
    """An older plug-in whose instances take no new attributes."""

    __slots__ = ("params",)

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        return Decision(job.spec.gpus.max, "slotted")


class SlottedLegacyUsagePolicy(SlottedLegacyPolicy):
    """Its subclass, asking for usage: it must not inherit what its base was given."""

    __slots__ = ()

    needs_usage = True


class BadObservesPolicy(LegacyPolicy):
    observes = frozenset({"temperature"})


class NoParamsPolicy:
    """Looks like a policy but has no `Params` model, so the registry must refuse it."""

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        return Decision(job.spec.gpus.min, "no params")
