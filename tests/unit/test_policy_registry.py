"""The policy registry: built-ins, plug-ins registered as entry points, and nothing else;
params; what a plug-in observes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator.policies.base import JobObservations, PolicyError, Signal
from herd_operator.policies.registry import (
    LegacyPlugin,
    find_policy_class,
    load_policy,
    plugin_names,
    reset_plugin_cache,
)
from herd_operator.policies.static import StaticPolicy
from herd_operator.specs import HerdJob, PolicyRef
from tests.unit.plugin_policy import (
    TEST_PLUGINS,
    HalfPolicy,
    SlottedLegacyPolicy,
    SlottedLegacyUsagePolicy,
    install,
    write_distribution,
)

REPO = Path(__file__).resolve().parents[2]
NOTHING_OBSERVED = JobObservations(started_at=0.0, allocated=0)
BUILTINS = "goodput, memory, schedule, static (built-in)"
HOW_TO_REGISTER = (
    "a plug-in registers its class under the entry point group 'herd_operator.policies' in"
    " its package's metadata and is installed where the operator runs (docs/policies.md)"
)
TEST_PLUGIN_NAMES = ", ".join(sorted(TEST_PLUGINS))


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Each test reads the entry points installed for it, and leaves none behind."""
    reset_plugin_cache()
    yield
    reset_plugin_cache()


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
    assert error.message == "must be at least 1, got integer 0"
    assert str(error) == "spec.policy.params.gpus: must be at least 1, got integer 0"


def test_static_rejects_an_unknown_param_naming_it() -> None:
    error = policy_error(PolicyRef(params={"gpu": 2}))
    assert error.field == "spec.policy.params.gpu"
    assert error.message == "unknown field (allowed: gpus)"


def test_unknown_policy_lists_what_is_allowed_and_how_to_register() -> None:
    error = policy_error(PolicyRef(name="nope"))
    assert error.field == "spec.policy.name"
    assert error.message == (
        f"unknown policy 'nope'; allowed: {BUILTINS}, none (installed plug-ins); {HOW_TO_REGISTER}"
    )


def test_unknown_policy_lists_the_installed_plugins_of_the_group_only(
    plugins_installed: Path,
) -> None:
    write_distribution(plugins_installed, "other-tool", {"other": "os:getcwd"}, "other.group")
    error = policy_error(PolicyRef(name="other"))
    assert error.message == (
        f"unknown policy 'other'; allowed: {BUILTINS}, {TEST_PLUGIN_NAMES} (installed"
        f" plug-ins); {HOW_TO_REGISTER}"
    )
    assert plugin_names() == sorted(TEST_PLUGINS)


def write_marking_module(directory: Path, module: str, marker: Path) -> None:
    """A module that leaves `marker` when imported (and has a class that looks a policy)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{module}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from pydantic import BaseModel\n"
        "class Policy:\n"
        "    class Params(BaseModel):\n"
        "        pass\n"
    )


def test_a_module_and_class_name_is_refused_without_importing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec is data: it once made the operator import any module it named."""
    marker = tmp_path / "imported"
    write_marking_module(tmp_path / "modules", "herd_test_marking", marker)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    assert "unittest.__main__" not in sys.modules
    for name in ("herd_test_marking:Policy", "unittest.__main__:TestProgram"):
        error = policy_error(PolicyRef(name=name))
        assert error.field == "spec.policy.name"
        assert error.message == (
            f"{name!r} is a module:Class reference, which is not loaded (a spec does not make"
            f" the operator import a module); allowed: {BUILTINS}, none (installed plug-ins);"
            f" {HOW_TO_REGISTER}"
        )
    assert not marker.exists()
    assert "herd_test_marking" not in sys.modules
    assert "unittest.__main__" not in sys.modules


def test_plugin_loads_by_its_entry_point(plugins_installed: Path) -> None:
    found: object = find_policy_class("half")
    assert found is HalfPolicy
    policy = load_policy(PolicyRef(name="half"))
    assert isinstance(policy, HalfPolicy)
    assert policy.desired(make_job(1, 5), NOTHING_OBSERVED, 0.0).gpus == 2


def test_plugin_params_are_validated_by_its_model(plugins_installed: Path) -> None:
    policy = load_policy(PolicyRef(name="half", params={"round_up": True}))
    assert policy.desired(make_job(1, 5), NOTHING_OBSERVED, 0.0).gpus == 3
    error = policy_error(PolicyRef(name="half", params={"round_up": "yes"}))
    assert error.field == "spec.policy.params.round_up"
    assert error.message == "expected a boolean (true or false), got string 'yes'"
    error = policy_error(PolicyRef(name="half", params={"whole": 1}))
    assert error.field == "spec.policy.params.whole"


def test_a_plugin_installed_later_is_found_after_a_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry points are read once: a reset (or a restart) sees a newly installed one."""
    assert policy_error(PolicyRef(name="half")).message.startswith("unknown policy 'half'")
    site = tmp_path / "site-packages"
    write_distribution(site, "herd-late-plugin", {"half": TEST_PLUGINS["half"]})
    monkeypatch.syspath_prepend(str(site))
    assert policy_error(PolicyRef(name="half")).message.startswith("unknown policy 'half'")
    reset_plugin_cache()
    assert isinstance(load_policy(PolicyRef(name="half")), HalfPolicy)


def test_the_example_plugin_is_registered_by_its_pyproject(
    example_plugin_installed: Path,
) -> None:
    policy = load_policy(PolicyRef(name="loss-plateau", params={"patience": 2}))
    assert type(policy).__name__ == "LossPlateauPolicy"
    assert policy.observes == {Signal.EPOCHS}


@pytest.mark.parametrize(
    ("name", "observes"),
    [
        ("static", set()),
        ("memory", {Signal.EPOCHS, Signal.USAGE}),
        ("schedule", {Signal.EPOCHS}),
        ("goodput", {Signal.EPOCHS}),
        ("half", set()),
    ],
)
def test_policies_declare_what_they_observe(
    name: str, observes: set[Signal], plugins_installed: Path
) -> None:
    params = {"steps": [{"atEpoch": 1, "gpus": 2}]} if name == "schedule" else {}
    assert load_policy(PolicyRef(name=name, params=params)).observes == observes


@pytest.mark.parametrize(
    ("name", "observes"),
    [
        ("legacy", {Signal.EPOCHS}),
        ("legacy-usage", {Signal.EPOCHS, Signal.USAGE}),
        ("slotted-legacy", {Signal.EPOCHS}),
        ("slotted-legacy-usage", {Signal.EPOCHS, Signal.USAGE}),
    ],
)
def test_a_plugin_that_declares_nothing_observes_what_every_policy_once_did(
    name: str, observes: set[Signal], plugins_installed: Path
) -> None:
    # Before policies declared it, every policy saw the epochs, and the GPU usage when its
    # class said `needs_usage = True`: such a plug-in keeps working as it did.
    for _ in range(2):  # giving it once changes nothing for the next load
        policy = load_policy(PolicyRef(name=name))
        assert policy.observes == observes
        assert policy.desired(make_job(1, 4), NOTHING_OBSERVED, 0.0).gpus == 4
    assert load_policy(PolicyRef(name="legacy")).observes == {Signal.EPOCHS}


def test_an_older_slotted_plugin_class_is_left_as_it_is(plugins_installed: Path) -> None:
    """Its instances take no attribute; the registry once set `observes` on its class,
    which its subclass then inherited in place of the usage it asks for."""
    slotted = load_policy(PolicyRef(name="slotted-legacy"))
    assert isinstance(slotted, LegacyPlugin)
    assert isinstance(slotted.policy, SlottedLegacyPolicy)
    assert "observes" not in vars(SlottedLegacyPolicy)
    with_usage = load_policy(PolicyRef(name="slotted-legacy-usage"))
    assert with_usage.observes == {Signal.EPOCHS, Signal.USAGE}
    assert not hasattr(SlottedLegacyUsagePolicy, "observes")
    assert slotted.desired(make_job(1, 3), NOTHING_OBSERVED, 0.0).reason == "slotted"


def test_observing_something_unknown_is_refused_naming_the_policy(
    plugins_installed: Path,
) -> None:
    error = policy_error(PolicyRef(name="bad-observes"))
    assert error.field == "spec.policy.name"
    assert error.message == (
        "'bad-observes' declares it observes frozenset({'temperature'}): expected a frozenset"
        " of epochs, usage"
    )


def test_class_without_params_is_not_a_policy(plugins_installed: Path) -> None:
    error = policy_error(PolicyRef(name="no-params"))
    assert error.field == "spec.policy.name"
    assert error.message == (
        "plug-in 'no-params' (tests.unit.plugin_policy:NoParamsPolicy) is not a policy class"
        " (it needs a pydantic 'Params' model)"
    )


def test_an_entry_point_to_a_missing_class_or_module_cannot_be_loaded(
    plugins_installed: Path,
) -> None:
    error = policy_error(PolicyRef(name="missing-class"))
    assert error.field == "spec.policy.name"
    assert error.message.startswith("cannot load plug-in 'missing-class': ")
    assert "Missing" in error.message
    error = policy_error(PolicyRef(name="missing-module"))
    assert error.message == (
        "cannot load plug-in 'missing-module': No module named 'no_such_module_here'"
    )


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
    """A plug-in that exits (as `unittest.__main__` does on import) once ended the operator."""
    module = f"herd_test_hostile_{abs(hash(module_text))}"
    (tmp_path / f"{module}.py").write_text(module_text)
    write_distribution(tmp_path, "herd-hostile", {"hostile": f"{module}:Exiting"})
    install(tmp_path, monkeypatch)
    with pytest.raises(PolicyError) as caught:
        load_policy(PolicyRef(name="hostile"))
    assert caught.value.field == "spec.policy.name"
    assert message in str(caught.value)


def test_a_broken_plugin_is_imported_once_until_a_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its module would otherwise run again on every reconcile of every job that names it."""
    imports = tmp_path / "imports"
    (tmp_path / "herd_test_broken.py").write_text(
        f"with open({str(imports)!r}, 'a') as log:\n"
        "    log.write('imported\\n')\n"
        "raise RuntimeError('broken at import')\n"
    )
    write_distribution(tmp_path, "herd-broken", {"broken": "herd_test_broken:Policy"})
    install(tmp_path, monkeypatch)
    expected = "cannot load plug-in 'broken': broken at import"
    for _ in range(3):
        assert policy_error(PolicyRef(name="broken")).message == expected
    assert imports.read_text().splitlines() == ["imported"]
    # Its traceback is logged once, since the message alone is kept.
    (record,) = [r for r in caplog.records if r.name == "herd_operator.policies.registry"]
    assert record.getMessage() == (
        "plug-in policy 'broken' (herd_test_broken:Policy) cannot be loaded"
    )
    assert record.exc_info is not None
    reset_plugin_cache()
    assert policy_error(PolicyRef(name="broken")).message == expected
    assert imports.read_text().splitlines() == ["imported", "imported"]


def test_validate_refuses_a_module_reference_without_importing_it(tmp_path: Path) -> None:
    """`herd-operator validate` in a process of its own, with the test plug-ins installed
    on its PYTHONPATH as a plug-in's users install one: a registered name is accepted; a
    module:Class name is a spec error, and its module is not imported."""
    site = tmp_path / "site-packages"
    write_distribution(site, "herd-test-plugins", TEST_PLUGINS)
    marker = tmp_path / "imported"
    write_marking_module(tmp_path / "modules", "herd_test_marking", marker)
    specs = {
        "plugin.yaml": "half",
        "unittest.yaml": "unittest.__main__:TestProgram",
        "marking.yaml": "herd_test_marking:Policy",
    }
    for file_name, policy in specs.items():
        (tmp_path / file_name).write_text(
            "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
            f"metadata:\n  name: {file_name.removesuffix('.yaml')}\n"
            "spec:\n  command: [python, train.py]\n  gpus: {min: 1, max: 2}\n"
            f"  policy:\n    name: {policy}\n"
        )
    script = (
        "import sys\n"
        "from herd_operator.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "print(sorted(m for m in sys.modules if m in {'unittest.__main__', 'herd_test_marking'}))\n"
        "sys.exit(code)\n"
    )
    path = os.pathsep.join(map(str, (REPO, site, tmp_path / "modules")))
    done = subprocess.run(
        [sys.executable, "-c", script, "validate", *(str(tmp_path / f) for f in specs)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )
    allowed = f"allowed: {BUILTINS}, {TEST_PLUGIN_NAMES} (installed plug-ins); {HOW_TO_REGISTER}"
    assert done.stderr.splitlines() == [
        f"{tmp_path / file_name}: spec.policy.name: {specs[file_name]!r} is a module:Class"
        " reference, which is not loaded (a spec does not make the operator import a module);"
        f" {allowed}"
        for file_name in ("unittest.yaml", "marking.yaml")
    ]
    assert done.stdout == "[]\n"
    assert done.returncode == 1
    assert not marker.exists()
