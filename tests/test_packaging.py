"""The distribution works installed as users install it: not editable, not from a checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_of_the_tree_is_in_the_distribution() -> None:
    """The packages are listed (for herd_operator.examples, built from examples/): a new
    package of the tree that is not listed would be missing from every wheel."""
    setuptools_config = PYPROJECT["tool"]["setuptools"]
    found = find_packages(str(REPO), include=["herd_operator*"])
    data = ["herd_operator.examples", "herd_operator.examples.specs"]
    assert sorted(setuptools_config["packages"]) == sorted([*found, *data])
    assert setuptools_config["package-dir"] == {"herd_operator.examples": "examples"}
    # The user's top-level folders are installed through herd_operator's links to them only.
    for name in ("specs", "policies", "controllers", "exporters"):
        assert (REPO / "herd_operator" / name).resolve() == REPO / name
        assert f"herd_operator.{name}" in setuptools_config["packages"]


def test_the_torchrun_extra_installs_torch_and_no_horovod() -> None:
    """`pip install 'herd-operator[torchrun]'`: the torchrun engine and its examples, no
    Horovod anywhere (tests/unit/test_torchrun.py imports the engine without it)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {requirement.split(">")[0].split("=")[0] for requirement in extras["torchrun"]}
    assert "torch" in names
    assert not any("horovod" in requirement.lower() for requirement in extras["torchrun"])
    assert not any(
        "horovod" in requirement.lower() for requirement in PYPROJECT["project"]["dependencies"]
    )
    # What the train extra has for the examples, the torchrun extra has too.
    assert {r for r in extras["train"] if "horovod" not in r} == set(extras["torchrun"])


DISTRIBUTED = (
    "pyproject.toml",
    "README.md",
    "herd_operator",
    "specs",
    "controllers",
    "policies",
    "exporters",
    "examples",
    # Not installed: built from, so that the test sees setuptools leave it out.
    "devtools",
)
CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")

# Run in the installed copy, away from the checkout: where the package came from, where the
# demo finds its examples, and what it stages for its jobs.
LOOKUP = """
import json, sys, tempfile
from pathlib import Path
import herd_operator
from herd_operator.cli.demo import DEMO_SCRIPT, DEMO_SPECS, find_examples, stage_examples
from herd_operator.specs import HerdJob  # a `specs/` folder where it runs must not shadow it
from herd_operator.bench.suite import BENCHMARKS, run_bench  # the whole registry, without devtools
from herd_operator.bench.training import train_command
examples = find_examples()
staged = stage_examples(examples, Path(tempfile.mkdtemp()))
outcomes, _, _ = run_bench(
    quick=True, only="arbitration", output=Path(tempfile.mkdtemp()), repeat=1, argv=[]
)
print(json.dumps({
    "package": herd_operator.__file__,
    "examples": str(examples),
    "staged": sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()),
    "benchmarks": [bench.name for bench in BENCHMARKS],
    "bench_ran": [(o.benchmark, len(o.rows), o.skipped, o.error) for o in outcomes],
    "training_script": train_command(Path("steps.txt"))[1],
}))
"""


@pytest.mark.timeout(300)
def test_the_demo_finds_its_examples_in_a_non_editable_install(tmp_path: Path) -> None:
    # Built from a copy: pip builds in the source tree and would leave build/ in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in DISTRIBUTED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=CACHES)
        else:
            shutil.copy2(REPO / name, source / name)
    target = tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",  # the venv's setuptools: no index needed
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # (`bin` holds the console script, which --target installs beside the packages.)
    installed = sorted(
        p.name for p in target.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info")
    )
    assert installed == ["herd_operator"], "one importable name in site-packages"
    (top_level,) = target.glob("*.dist-info/top_level.txt")
    assert top_level.read_text().split() == ["herd_operator"]
    # The wheel's own list of its files: nothing of the checkout's developer tooling.
    (record,) = target.glob("*.dist-info/RECORD")
    shipped = [line.partition(",")[0] for line in record.read_text().splitlines()]
    assert [path for path in shipped if "devtools" in path] == []
    assert "herd_operator/bench/suite.py" in shipped
    # The Horovod build (README: Installing the package): its script, its patch and its
    # console script, so that a pip install can build the wheel the train extra needs.
    assert "herd_operator/horovod_build/build-horovod.sh" in shipped
    assert "herd_operator/horovod_build/horovod-0.28.1.patch" in shipped
    (entry_points,) = target.glob("*.dist-info/entry_points.txt")
    assert "herd-operator-build-horovod = herd_operator.horovod_build:main" in (
        entry_points.read_text()
    )
    # Where users run `herd-operator run --specs-dir specs`: a folder of theirs named specs.
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "__init__.py").write_text("raise ImportError('the user folder')\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    lookup = subprocess.run(
        [sys.executable, "-c", LOOKUP],
        cwd=tmp_path,  # not the checkout: nothing found through the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lookup.returncode == 0, lookup.stderr[-3000:]
    found = json.loads(lookup.stdout)
    assert Path(found["package"]).is_relative_to(target)  # the installed copy, not the checkout
    assert Path(found["examples"]) == target / "herd_operator" / "examples"
    assert found["staged"] == [
        "examples/specs/digits-a.yaml",
        "examples/specs/digits-b.yaml",
        "examples/train_digits.py",
    ]
    # What the checkout's examples/ holds apart from the demo's files is not shipped as
    # part of the package (the plug-in example is a distribution of its own).
    assert not (target / "herd_operator" / "examples" / "plugins").exists()
    # `herd-operator bench` works from the installed copy alone: its registry imports, and a
    # benchmark runs (`devtools` is not on the path there).
    assert "arbitration" in found["benchmarks"]
    assert found["bench_ran"] == [["arbitration", 1, None, None]]
    # resize-stall and training-overhead run the example training script that the package
    # carries (not one of a checkout, which an installed package has not).
    script = Path(found["training_script"])
    assert script == target / "herd_operator" / "examples" / "train_digits.py"
    assert script.is_file()


def test_the_demo_says_what_is_missing_when_the_examples_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from herd_operator.cli import demo

    monkeypatch.setattr(demo, "CHECKOUT_EXAMPLES", tmp_path / "no-checkout")
    monkeypatch.setattr(demo.importlib.resources, "files", lambda package: tmp_path / "empty")
    assert demo.find_examples() is None
    assert demo.run_demo(tmp_path / "demo", 4, 10.0) == 1
    err = capsys.readouterr().err
    assert "the example jobs are missing from this installation" in err
    assert str(tmp_path / "no-checkout") in err
    assert not (tmp_path / "demo").exists()  # nothing made before the check


BUILD_CHOICE = """
import sys
from herd_operator import horovod_build
print(horovod_build.BUILD_SCRIPT, flush=True)
sys.exit(horovod_build.main([]))
"""


@pytest.mark.timeout(300)
def test_the_sdist_and_the_installed_package_carry_the_horovod_build(tmp_path: Path) -> None:
    """`pip install 'herd-operator[train]'` cannot build Horovod 0.28.1 as released: the
    sdist carries the script and the patch that build it, and, installed from a wheel,
    the console script's entry runs the installed script (a dry run: the choice only)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in DISTRIBUTED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=CACHES)
        else:
            shutil.copy2(REPO / name, source / name)
    make_sdist = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    sdist = subprocess.run(
        [sys.executable, "-c", make_sdist],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    with tarfile.open(source / "dist" / sdist.stdout.split()[-1]) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    assert "herd_operator/horovod_build/build-horovod.sh" in names
    assert "herd_operator/horovod_build/horovod-0.28.1.patch" in names

    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target), "HERD_HOROVOD_DRY_RUN": "1"}
    chosen = subprocess.run(
        [sys.executable, "-c", BUILD_CHOICE], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    script, choice, *build_env = chosen.stdout.splitlines()
    assert Path(script) == target / "herd_operator" / "horovod_build" / "build-horovod.sh"
    assert choice.startswith("flavour=")
    assert "HOROVOD_WITH_PYTORCH=1" in build_env
