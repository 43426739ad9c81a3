"""The policy registry: built-in `static`, `module:Class` plug-ins, entry points, params."""

from __future__ import annotations

from importlib.metadata import EntryPoint, EntryPoints
from pathlib import Path
from typing import Any

import pytest

from policies import registry
from policies.base import JobObservations, PolicyError, Signal
from policies.registry import ENTRY_POINT_GROUP, find_policy_class, load_policy
from policies.static import StaticPolicy
from specs import HerdJob, PolicyRef
from tests.unit.plugin_policy import HalfPolicy

PLUGIN = "tests.unit.plugin_policy"
EXAMPLE_PLUGINS = Path(__file__).parents[2] / "examples" / "plugins"
NOTHING_OBSERVED = JobObservations(started_at=0.0, allocated=0)


def make_job(low: int = 1, high: int = 4) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "train"},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": low, "max": high}},
        }
    )


def policy_error(ref: PolicyRef) -> PolicyError:
    with pytest.raises(PolicyError) as caught:
        load_policy(ref)
    return caught.value


def test_static_by_default_asks_for_max() -> None:
    policy = load_policy(PolicyRef())
    assert isinstance(policy, StaticPolicy)
    decision = policy.desired(make_job(1, 4), NOTHING_OBSERVED, 0.0)
    assert (decision.gpus, decision.reason) == (4, "static: max 4")


@pytest.mark.parametrize(
    ("asked", "low", "high", "gpus"),
    [(2, 1, 4, 2), (8, 1, 4, 4), (1, 3, 4, 3)],
)
def test_static_count_is_clamped_into_min_max(asked: int, low: int, high: int, gpus: int) -> None:
    policy = load_policy(PolicyRef(name="static", params={"gpus": asked}))
    decision = policy.desired(make_job(low, high), NOTHING_OBSERVED, 0.0)
    assert decision.gpus == gpus
    assert decision.reason == f"static: {asked} GPUs asked, {gpus} within min/max"


def test_static_rejects_zero_gpus_naming_the_param() -> None:
    error = policy_error(PolicyRef(params={"gpus": 0}))
    assert error.field == "spec.policy.params.gpus"
    assert error.message == "Input should be greater than or equal to 1"
    assert str(error) == "spec.policy.params.gpus: Input should be greater than or equal to 1"


def test_static_rejects_an_unknown_param_naming_it() -> None:
    error = policy_error(PolicyRef(params={"gpu": 2}))
    assert error.field == "spec.policy.params.gpu"
    assert error.message == "Extra inputs are not permitted"


def test_unknown_policy_lists_the_known_names() -> None:
    error = policy_error(PolicyRef(name="nope"))
    assert error.field == "spec.policy.name"
    prefix, suffix = "unknown policy 'nope' (known: ", "; or use 'module:Class')"
    assert error.message.startswith(prefix)
    assert error.message.endswith(suffix)
    known = error.message[len(prefix) : -len(suffix)].split(", ")
    assert "static" in known
    assert known == sorted(known)


def test_plugin_loads_by_module_and_class() -> None:
    policy = load_policy(PolicyRef(name=f"{PLUGIN}:HalfPolicy"))
    assert isinstance(policy, HalfPolicy)
    assert policy.desired(make_job(1, 5), NOTHING_OBSERVED, 0.0).gpus == 2


def test_plugin_params_are_validated_by_its_model() -> None:
    policy = load_policy(PolicyRef(name=f"{PLUGIN}:HalfPolicy", params={"round_up": True}))
    assert policy.desired(make_job(1, 5), NOTHING_OBSERVED, 0.0).gpus == 3
    error = policy_error(PolicyRef(name=f"{PLUGIN}:HalfPolicy", params={"round_up": "yes"}))
    assert error.field == "spec.policy.params.round_up"
    assert error.message == "Input should be a valid boolean"
    error = policy_error(PolicyRef(name=f"{PLUGIN}:HalfPolicy", params={"whole": 1}))
    assert error.field == "spec.policy.params.whole"


@pytest.mark.parametrize(
    ("name", "observes"),
    [
        ("static", set()),
        ("memory", {Signal.EPOCHS, Signal.USAGE}),
        ("schedule", {Signal.EPOCHS}),
        (f"{PLUGIN}:HalfPolicy", set()),
        ("herd_example_policy:LossPlateauPolicy", {Signal.EPOCHS}),
    ],
)
def test_policies_declare_what_they_observe(
    name: str, observes: set[Signal], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGINS))
    params = {"steps": [{"atEpoch": 1, "gpus": 2}]} if name == "schedule" else {}
    assert load_policy(PolicyRef(name=name, params=params)).observes == observes


@pytest.mark.parametrize(
    ("name", "observes"),
    [
        ("LegacyPolicy", {Signal.EPOCHS}),
        ("LegacyUsagePolicy", {Signal.EPOCHS, Signal.USAGE}),
        ("SlottedLegacyPolicy", {Signal.EPOCHS}),
    ],
)
def test_a_plugin_that_declares_nothing_observes_what_every_policy_once_did(
    name: str, observes: set[Signal]
) -> None:
    # Before policies declared it, every policy saw the epochs, and the GPU usage when its
    # class said `needs_usage = True`: such a plug-in keeps working as it did.
    for _ in range(2):  # filling it in once changes nothing for the next load
        assert load_policy(PolicyRef(name=f"{PLUGIN}:{name}")).observes == observes
    assert load_policy(PolicyRef(name=f"{PLUGIN}:LegacyPolicy")).observes == {Signal.EPOCHS}


def test_observing_something_unknown_is_refused_naming_the_policy() -> None:
    name = f"{PLUGIN}:BadObservesPolicy"
    error = policy_error(PolicyRef(name=name))
    assert error.field == "spec.policy.name"
    assert error.message == (
        f"{name!r} declares it observes frozenset({{'temperature'}}): expected a frozenset of"
        " epochs, usage"
    )


def test_class_without_params_is_not_a_policy() -> None:
    name = f"{PLUGIN}:NoParamsPolicy"
    error = policy_error(PolicyRef(name=name))
    assert error.field == "spec.policy.name"
    assert error.message == f"{name!r} is not a policy class (it needs a pydantic 'Params' model)"


def test_missing_class_or_module_cannot_be_loaded() -> None:
    error = policy_error(PolicyRef(name=f"{PLUGIN}:Missing"))
    assert error.field == "spec.policy.name"
    assert error.message.startswith(f"cannot load '{PLUGIN}:Missing': ")
    assert "Missing" in error.message.removeprefix(f"cannot load '{PLUGIN}:Missing': ")
    error = policy_error(PolicyRef(name="no_such_module_here:Policy"))
    assert error.message == (
        "cannot load 'no_such_module_here:Policy': No module named 'no_such_module_here'"
    )


def fake_entry_points(*points: EntryPoint) -> Any:
    def select(**params: Any) -> EntryPoints:
        return EntryPoints(points).select(**params)

    return select


def test_entry_point_plugin_is_found_by_name_and_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    half = EntryPoint(name="half", value=f"{PLUGIN}:HalfPolicy", group=ENTRY_POINT_GROUP)
    other = EntryPoint(name="other", value=f"{PLUGIN}:HalfPolicy", group="some.other.group")
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(half, other))
    found: object = find_policy_class("half")
    assert found is HalfPolicy
    error = policy_error(PolicyRef(name="nope"))
    known = ", ".join(sorted({"half", *registry.BUILTIN_POLICIES}))
    assert error.message == f"unknown policy 'nope' (known: {known}; or use 'module:Class')"
    assert "other" not in known


def test_broken_entry_point_plugin_is_a_policy_error(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="no_such_module_here:Policy", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(broken))
    error = policy_error(PolicyRef(name="broken"))
    assert error.field == "spec.policy.name"
    assert error.message == "cannot load plug-in 'broken': No module named 'no_such_module_here'"


@pytest.mark.parametrize(
    ("module_text", "message"),
    [
        ("raise SystemExit(3)\n", "it tried to exit the process (SystemExit 3)"),
        ("raise RuntimeError('import-time bug')\n", "import-time bug"),
        (
            "from pydantic import BaseModel\n"
            "class Exiting:\n"
            "    class Params(BaseModel):\n"
            "        pass\n"
            "    def __init__(self, params):\n"
            "        raise SystemExit\n",
            "cannot be built: it tried to exit the process (SystemExit 0)",
        ),
    ],
    ids=["exit-on-import", "error-on-import", "exit-on-build"],
)
def test_a_plugin_that_raises_anything_is_a_spec_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module_text: str, message: str
) -> None:
    """`policy.name: unittest.__main__:TestProgram` once ended the operator (SystemExit)."""
    module = f"herd_test_hostile_{abs(hash(module_text))}"
    (tmp_path / f"{module}.py").write_text(module_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolicyError) as caught:
        load_policy(PolicyRef(name=f"{module}:Exiting"))
    assert caught.value.field == "spec.policy.name"
    assert message in str(caught.value)
